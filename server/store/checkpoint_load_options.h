// How a checkpoint load runs (LoadCheckpoint, CheckpointLoader): where it
// allocates, how it reads, what it may share or adopt instead of reading,
// whether peers supply the bytes, and what it reports. A plain value; what
// it points to is borrowed and outlives the load.
#ifndef WEIGHTD_SERVER_STORE_CHECKPOINT_LOAD_OPTIONS_H_
#define WEIGHTD_SERVER_STORE_CHECKPOINT_LOAD_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/file_opener.h"
#include "server/auth/access_control.h"
#include "server/memory/host_memory.h"
#include "server/store/checkpoint.h"
#include "server/store/donated_checkpoints.h"
#include "server/store/load_tally.h"
#include "server/store/peer_source.h"
#include "server/store/resident_checkpoints.h"

namespace weightd {

struct CheckpointLoadOptions {
  HostMemoryManager* memory = nullptr;  // required; allocates and charges
  // Segments are filled up to this size; a file larger than it gets one of
  // its own.
  uint64_t segment_target_bytes = 1ull << 30;
  // Bytes per pread() call.
  uint64_t read_chunk_bytes = 16ull << 20;
  // Threads reading and digesting in parallel.
  int read_threads = 2;
  LoadProgressFn progress;  // optional; called from loader threads
  // Opens `path` and every file it leads to (the index, each shard it
  // names, each file of a directory), each once, and reads and stats them
  // through their fds (the file seam); the daemon passes its ModelRoots,
  // which confines them all to the model roots. nullptr:
  // UnconfinedFileOpener (tests, tools).
  const FileOpener* files = nullptr;
  // Optional: files already resident are shared, not read again; what this
  // load reads is registered there. Two loads of the same files that run at
  // once both read (the later one is what later loads share).
  ResidentCheckpoints* resident = nullptr;
  // Required with `resident`. When the checkpoint returned is shared
  // (nothing was read, or what was read is identical to a resident copy of
  // other files and was freed), set to the budget charge for the tensors'
  // metadata, which the caller holds for what it builds per model (names,
  // layout, generations); left null otherwise.
  std::unique_ptr<MemoryCharge>* shared_charge = nullptr;
  // Optional: segments a predecessor daemon handed over. A load of files
  // one of them describes adopts its segments instead of reading (checked
  // as DonatedCheckpoints::verify() says); a mismatch is logged and the
  // files are read.
  DonatedCheckpoints* donated = nullptr;
  // Optional: the daemon's peers, asked for the files' bytes unless
  // `source` is kStorage (see LoadCheckpoint). kPeers without `peers` is
  // FAILED_PRECONDITION.
  CheckpointPeers* peers = nullptr;
  LoadSource source = LoadSource::kStorage;
  int peer_streams = 4;  // ranges transferred from peers at once
  // Optional (with `resident` and `peers`, source kAuto): while this load
  // runs, peers this list admits may read the ranges it has read from
  // storage (LoadingCheckpoints). Null: nothing is offered before the load
  // ends (adapters).
  const ReaderList* offer_while_loading = nullptr;
  // While other daemons load the same files (partial holders), how often
  // the load asks its peers again what they have (doubling, up to 16
  // times, while nothing changes and it waits for no other load's
  // chunks), and how long it waits for a partial
  // holder that stopped reading new ranges before reading the ranges that
  // holder was to read from storage itself.
  absl::Duration peer_refresh = absl::Milliseconds(250);
  absl::Duration peer_patience = absl::Seconds(10);
  // Storage bytes sampled per file to pick a holder's copy and turn away
  // other content early (pieces of peer_sample_bytes at random offsets, new
  // ones each load; sent to the peers), and as many again, never sent, to
  // compare with what the peers send (or more: peer_verify).
  int peer_samples_per_file = 8;
  uint64_t peer_sample_bytes = 64 << 10;
  PeerVerify peer_verify;
  // Optional out: where the bytes came from.
  LoadSourceReport* report = nullptr;
  // Optional out: the files this load opened, in order (the checkpoint
  // returned may list another copy's: a shared identical copy).
  std::vector<std::string>* opened_files = nullptr;
  // Optional: where memory already holds the bytes of a freshly read
  // checkpoint's tensors (one entry per tensor, in tensors() order; empty
  // where nothing does). When those make up over 1/8 of the checkpoint,
  // its tensors point at them and the rest moves to a segment of its size
  // (the files' segments are freed): see ShareHeldTensors.
  FindHeldFn find_held;
  // Optional: the load ends CANCELLED once this is cancelled (an unload of
  // its name, its client gone), between its phases and chunks, and with
  // the source requests it has in flight (OpenedFile::cancel); everything
  // it allocated is freed as for any failure.
  const Cancellation* cancel = nullptr;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_CHECKPOINT_LOAD_OPTIONS_H_
