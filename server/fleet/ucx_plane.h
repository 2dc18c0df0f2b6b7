// The fleet's bulk data plane over UCX (issue 41): a holder grants peers
// reads of the segments of checkpoints it offers, and a loader reads
// ranges of them straight into its own new segment. gRPC stays the control
// plane: grants travel in FindCheckpointResponse, only after its
// authentication and fleet-member check (server/grpc/ucx_offer.h).
//
// Why not one-sided ucp_get_nbx with packed rkeys: in UCX 1.13 a GET over
// TCP (and PUT, with UCX_TCP_PUT_ENABLE) is emulated by the target's
// worker, which copies from (or to) whatever address the request names
// without looking at any key (ucp/rma/rma_sw.c, uct/tcp/tcp_ep.c): a key
// could be neither scoped nor revoked, a stale key would read other bytes
// or crash the holder, and any process reaching the worker could read the
// daemon's memory. So the context asks only for active messages
// (UCP_FEATURE_AM, UCX_TCP_PUT_ENABLE=n unless set), and a read is a
// request the holder checks: a grant (id, 128-bit random token, the byte
// range it covers) names a region the holder registered once
// (ucp_mem_map, per segment, on first offer); the reply carries the bytes
// from that registered memory, and UCX's rendezvous moves them zero-copy
// where the transport can (RDMA GET on verbs, CMA on one host; AM
// fragments on TCP) straight into the loader's destination. A request with
// an unknown grant, a wrong token or bytes outside the grant is answered
// with an error and no bytes; a segment's grants go, and its registration
// is unmapped, in the segment's release hook, before its memory is freed
// (a reply in flight holds the segment), so a stale grant gets NOT_FOUND,
// never other bytes.
//
// Progress: one thread of the plane owns the worker and every endpoint;
// callers (a load's stream threads, the gRPC pool granting) post work to
// it and wait on their own request. Many reads are in flight at once
// (one per stream).
//
// Built without UCX (CMake WEIGHTD_UCX=OFF, or no pkg-config `ucx`),
// Start fails UNAVAILABLE saying so. Thread-safe.
#ifndef WEIGHTD_SERVER_FLEET_UCX_PLANE_H_
#define WEIGHTD_SERVER_FLEET_UCX_PLANE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/memory/segment.h"

namespace weightd {

// --peer-transport: how a loader reads bytes from a holder. kGrpc:
// ReadCheckpoint streams only (no UCX worker at all); kAuto: UCX where the
// holder offers it, gRPC from the others; kUcx: UCX only (a holder that
// offers no UCX is not used; the daemon fails to start without UCX).
enum class PeerTransport { kGrpc, kAuto, kUcx };
absl::StatusOr<PeerTransport> ParsePeerTransport(absl::string_view s);
const char* PeerTransportName(PeerTransport t);

// A holder's permission to read bytes [0, length) of one region (a file's
// data section): FindCheckpointResponse.ucx_files.
struct UcxGrant {
  uint64_t id = 0;
  std::string token;  // 16 random bytes
  uint64_t length = 0;
};

class UcxPlane {
 public:
  // Starts UCX (context, worker, progress thread). UNAVAILABLE, saying
  // why, when built without UCX or UCX finds no transport.
  static absl::StatusOr<std::unique_ptr<UcxPlane>> Start();
  ~UcxPlane();
  UcxPlane(const UcxPlane&) = delete;
  UcxPlane& operator=(const UcxPlane&) = delete;

  // The transports (TL/device) the worker can use, for the start log.
  std::string transports() const;
  // This worker's address (what a loader connects to).
  const std::string& worker_address() const;

  // Holder: a grant for bytes [offset, offset + length) of `segment`
  // (registered with UCX on its first grant). The same range gets the same
  // grant while the segment lives.
  absl::StatusOr<UcxGrant> Grant(const SegmentPtr& segment, uint64_t offset, uint64_t length);

  // Loader: `length` bytes at `offset` of `grant` from the holder `peer`
  // (for logs) whose worker is `worker`, into `dest`. UNAVAILABLE when the
  // endpoint fails, DEADLINE_EXCEEDED past `timeout`, NOT_FOUND for a
  // grant the holder no longer has (its segment went), DATA_LOSS for a
  // reply of another length. Returns once UCX no longer writes to `dest`.
  absl::Status Read(const std::string& peer, const std::string& worker, const UcxGrant& grant,
                    uint64_t offset, uint64_t length, uint8_t* dest, absl::Duration timeout);

  // Holder: drops every grant of `segment` (testing the stale-key path
  // without waiting for an unload: the same as its release hook).
  void Revoke(uint64_t segment_id);

  struct Stats {
    uint64_t regions = 0;            // segments registered now
    uint64_t bytes_sent = 0;         // granted bytes sent to loaders
    uint64_t requests_refused = 0;   // unknown grant, wrong token, out of range
    std::map<std::string, uint64_t> bytes_by_peer;  // received, by holder address
    std::map<std::string, std::string> transport_by_peer;  // what each endpoint chose
  };
  Stats stats() const;

  struct Impl;

 private:
  explicit UcxPlane(std::shared_ptr<Impl> impl);
  // Shared with the segments' release hooks (weakly).
  std::shared_ptr<Impl> impl_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_FLEET_UCX_PLANE_H_
