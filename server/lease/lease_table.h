// Leases: a client's hold on what a fetch returned.
//
// A lease pins the segments its tensors live in (shared_ptr), so their bytes
// stay mapped and unchanged however the model moves on. It ends on Release,
// when the data connection it is attached to closes (the client died or
// let go), or when its TTL runs out: a lease nobody attached or read within
// `idle_ttl` is reclaimed, covering clients that hang or never collect.
// An ended lease that held the last reference to large segments (a model
// unloaded while leased) is handed to the Disposer, if one is given, so the
// caller's thread does not wait for the kernel to free them.
//
// Thread-safe.
#ifndef WEIGHTD_SERVER_LEASE_LEASE_TABLE_H_
#define WEIGHTD_SERVER_LEASE_LEASE_TABLE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "server/kernels/merge_elements.h"
#include "server/memory/disposer.h"
#include "server/memory/buffer.h"

namespace weightd {

using LeaseToken = std::array<uint8_t, 16>;

// A merge a push makes as it writes (FetchParams::defer_merges): the
// parameter's rows are `cols` elements long, the lease tensor's bytes start
// at row `row_begin`, and `terms` (server/kernels/merge_elements.h) are applied to
// each element, their arrays kept alive by `hold` (the patches).
struct PushMerge {
  int64_t cols = 1;
  int64_t row_begin = 0;
  std::vector<MergeTerm> terms;
  std::vector<std::shared_ptr<const void>> hold;
};

// Where one tensor of a lease lies: bytes [offset, offset + length) of
// buffers[buffer].
//
// A tensor of a lease fetched for a push with its casts deferred
// (FetchParams::defer_casts) holds its source: `length` bytes of
// `src_dtype`, which the push converts to `dst_dtype` as it writes them (on
// the GPU for a CUDA push), merging `merge` on the way when it is set.
// PushLength() is what the destination receives.
struct LeaseTensor {
  uint32_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool cast = false;
  DType src_dtype = DType::kF32;  // with `cast`
  DType dst_dtype = DType::kF32;  // with `cast`
  // With `cast`: the merge the conversion makes on the way (null: none).
  std::shared_ptr<const PushMerge> merge;
};

// The bytes a push writes for `t`: `length`, or its elements in dst_dtype.
inline uint64_t PushLength(const LeaseTensor& t) {
  return t.cast ? t.length / DTypeSize(t.src_dtype) * DTypeSize(t.dst_dtype) : t.length;
}

// Who fetched a lease and what it exposes (server/auth/access_control.h;
// the table only keeps it).
struct LeaseOwner;

struct LeaseContents {
  std::string model;
  uint64_t generation = 0;
  // Indexed as the fetch response's segments; of any memory kind (a
  // transport refuses a kind it cannot carry).
  std::vector<BufferPtr> buffers;
  uint64_t bytes = 0;                // bytes of the tensors it names
  // The tensors, in the fetch response's order (a push writes these);
  // shared by every lease on the same fetch table. May be null (none).
  std::shared_ptr<const std::vector<LeaseTensor>> tensors;
  // Kept alive exactly as long as the lease (its owner's marker: e.g. the
  // generation it serves counts its leases by this pointer's use_count).
  std::shared_ptr<const void> hold;
  // Who fetched it, for the access checks of its later uses; null when it
  // was fetched without a caller (in-process callers, tests).
  std::shared_ptr<const LeaseOwner> owner;
  // Fetched with its casts deferred to the push (some tensors hold their
  // source bytes, LeaseTensor::cast): it can only be pushed; the data
  // socket refuses to attach its segments and Read to stream them.
  bool push_only = false;
};

struct LeaseGrant {
  uint64_t id = 0;
  LeaseToken token{};
};

class LeaseTable {
 public:
  // `disposer` (may be null) must outlive the table.
  explicit LeaseTable(absl::Duration idle_ttl, Disposer* disposer = nullptr)
      : idle_ttl_(idle_ttl), disposer_(disposer) {}

  LeaseGrant Grant(LeaseContents contents) ABSL_LOCKS_EXCLUDED(mu_);

  // The lease's contents; extends its TTL. NOT_FOUND for an unknown or
  // expired id, PERMISSION_DENIED for a wrong token.
  absl::StatusOr<std::shared_ptr<const LeaseContents>> Use(
      uint64_t id, absl::string_view token) ABSL_LOCKS_EXCLUDED(mu_);

  // The lease's contents, with no token and without touching its TTL (for
  // an access check before a use); NOT_FOUND for an unknown or expired id.
  absl::StatusOr<std::shared_ptr<const LeaseContents>> Peek(uint64_t id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Ties the lease to data connection `connection` (no TTL from now on).
  // Unless `for_push` (a push writes the lease; an attach hands out its
  // segments), a push-only lease (LeaseContents::push_only) is
  // FAILED_PRECONDITION and stays as it was.
  absl::StatusOr<std::shared_ptr<const LeaseContents>> Attach(
      uint64_t id, absl::string_view token, uint64_t connection, bool for_push = false)
      ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status Release(uint64_t id, absl::string_view token) ABSL_LOCKS_EXCLUDED(mu_);

  // After a hand-over (server/state/handover.h): ids below `predecessor_next`
  // were granted by the daemon this one took over from. New ids start there
  // (an old lease's id never names a new lease); an attach or use of such
  // an id is UNAVAILABLE ("fetch again": the client's retry then fetches
  // from this daemon), and its Release is OK (nothing here holds it: the
  // client's mappings keep their bytes).
  void InheritIdsBelow(uint64_t predecessor_next) ABSL_LOCKS_EXCLUDED(mu_);
  // The id the next grant gets (what a successor must not reuse).
  uint64_t next_id() const ABSL_LOCKS_EXCLUDED(mu_);

  // Ends every lease attached to `connection`; returns how many.
  size_t ReleaseConnection(uint64_t connection) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends leases whose TTL ran out by `now`; returns how many.
  size_t Expire(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

  // Open leases on `model` at `generation`.
  size_t CountFor(absl::string_view model, uint64_t generation) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Lease {
    LeaseToken token;
    std::shared_ptr<const LeaseContents> contents;
    uint64_t connection = 0;  // 0 = not attached
    absl::Time deadline;
  };
  absl::StatusOr<Lease*> FindLocked(uint64_t id, absl::string_view token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends every lease `ends` is true of; returns how many.
  size_t EndWhere(const std::function<bool(const Lease&)>& ends) ABSL_LOCKS_EXCLUDED(mu_);
  // Lets go of ended leases' contents (outside mu_), through the disposer
  // when that frees large segments.
  void Drop(std::vector<std::shared_ptr<const LeaseContents>> dropped) ABSL_LOCKS_EXCLUDED(mu_);

  const absl::Duration idle_ttl_;
  Disposer* const disposer_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t inherited_below_ ABSL_GUARDED_BY(mu_) = 0;
  // NOT_FOUND for an id never granted here; UNAVAILABLE for a predecessor's.
  absl::Status UnknownLocked(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LEASE_LEASE_TABLE_H_
