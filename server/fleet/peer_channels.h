// The channels of a daemon's calls to the other daemons of its fleet (the
// peer table's polls, the checkpoint client's questions and range reads).
//
// One Models stub per peer address, made when first used and kept for the
// `capacity` most recently used addresses: an evicted one's connection
// closes once no call uses it (each channel has its own subchannels). Every
// channel presents this daemon's credentials and bearer token
// (common/grpc/credentials.h), and all of them share one receive budget (a
// gRPC resource quota): past it calls are cancelled RESOURCE_EXHAUSTED, so
// what peers send cannot take the loader's memory.
//
// Thread-safe: the polling threads and the loads share it. Owns the stubs
// and the quota; one mutex of its own (a leaf: nothing is called under it
// that takes another lock or blocks — channels connect lazily).
#ifndef WEIGHTD_SERVER_FLEET_PEER_CHANNELS_H_
#define WEIGHTD_SERVER_FLEET_PEER_CHANNELS_H_

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/resource_quota.h>
#include <grpcpp/security/credentials.h>

#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace grpc {
class ClientContext;
}  // namespace grpc

namespace weightd {

// The initial-metadata key of a daemon's instance id in its answers (a
// daemon recognizes itself among its peers by it: PeerTable).
inline constexpr char kInstanceMetadata[] = "weightd-instance";

// Whether the answer of the call made with `ctx` carries `instance_id` (the
// caller's own: the peer called is this daemon).
bool AnsweredBy(const grpc::ClientContext& ctx, absl::string_view instance_id);

class PeerChannels {
 public:
  // `creds` and `token` (empty: none) are presented on every call;
  // `receive_budget` bytes are what all channels together may buffer, and
  // no message may be larger.
  PeerChannels(size_t capacity, uint64_t receive_budget,
               std::shared_ptr<grpc::ChannelCredentials> creds, std::string token);
  PeerChannels(const PeerChannels&) = delete;
  PeerChannels& operator=(const PeerChannels&) = delete;

  // The stub for `address` (HOST:PORT), made now if it has none.
  std::shared_ptr<v1::Models::Stub> StubFor(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the stubs of addresses not in `keep` (calls using one keep it).
  void KeepOnly(const std::vector<std::string>& keep) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Entry = std::pair<std::shared_ptr<v1::Models::Stub>, std::list<std::string>::iterator>;

  // Constant after construction.
  const size_t capacity_;
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  const std::string token_;
  const int max_message_;

  // Own synchronization.
  grpc::ResourceQuota quota_;

  // Protected by mu_.
  absl::Mutex mu_;
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // most recently used first
  std::map<std::string, Entry> stubs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_FLEET_PEER_CHANNELS_H_
