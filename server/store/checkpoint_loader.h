// Loading a checkpoint: LoadCheckpoint, the one-call entry point, and the
// CheckpointLoader that runs a load's phases.
#ifndef WEIGHTD_SERVER_STORE_CHECKPOINT_LOADER_H_
#define WEIGHTD_SERVER_STORE_CHECKPOINT_LOADER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/file_opener.h"
#include "server/memory/host_memory.h"
#include "server/memory/segment.h"
#include "server/store/checkpoint.h"
#include "server/store/checkpoint_files.h"
#include "server/store/checkpoint_layout.h"
#include "server/store/checkpoint_load_options.h"
#include "server/store/donated_checkpoints.h"
#include "server/store/load_tally.h"
#include "server/store/peer_read.h"
#include "server/store/peer_source.h"
#include "server/store/resident_checkpoints.h"

namespace weightd {

// Loads `path`, which is a .safetensors file, a directory holding
// model.safetensors.index.json (or that index file itself), or a directory
// of *.safetensors files (sorted by name). Files are read with
// pread (never mmap: a file truncated under the daemon must not SIGBUS it)
// and checked unchanged (size, mtime) after reading: DATA_LOSS otherwise.
// The tensors' metadata (TensorMetadataBytes each) is charged to
// `options.memory` once the headers are parsed, before any data is read:
// RESOURCE_EXHAUSTED when it does not fit.
// Errors name the phase that failed (CheckpointLoader), then the file and
// the tensor. On failure nothing stays allocated or charged.
//
// From peers (options.source kAuto or kPeers, with options.peers): after
// the headers are read, storage is sampled (peer_samples_per_file ranges
// per file) and the peers are asked who holds the same files
// (CheckpointKey) with the same bytes at the samples; holders that agree
// on every tensor digest supply ranges of read_chunk_bytes, spread across
// them by rendezvous hashing, peer_streams at once. Once they have sent
// them, what they sent is compared with storage's bytes at places they
// were never told (peer_verify: pieces per file, a share of the bytes, or
// all of them). A peer that fails a
// range (error, stall past its deadline) is dropped for the rest of the
// load; one whose bytes miss a tensor digest, a sample or storage's bytes
// is dropped with a peer_data_loss (DATA_LOSS) event, and what it sent is
// fetched again (options.report counts it as discarded).
// What no peer supplies comes from storage (kAuto), or the load fails
// UNAVAILABLE (kPeers). Storage's bytes are the truth: when storage itself
// disagrees with the peers' digests, everything is read from storage
// (kPeers: DATA_LOSS). kPeers with no holder: UNAVAILABLE.
//
// With options.resident, files that are byte for byte those of a resident
// checkpoint at other paths (a copy: the same number of files, each with
// the same size and header, and data sections that compare equal after
// reading) are not kept twice: the copy just read is freed and the resident
// checkpoint returned, as for the same files (options.shared_charge).
absl::StatusOr<std::shared_ptr<const Checkpoint>> LoadCheckpoint(
    const std::string& path, const CheckpointLoadOptions& options);

// One load of one checkpoint (LoadCheckpoint above), a method per phase,
// run in this order by Load():
//   Open           the files, their headers parsed and checked ("open: ")
//   Charge         the tensors' metadata to the budget ("charge: ")
//   ShareResident  the same files resident already: shared, done
//   Layout         data sections in segments, tensors at their places
//   AdoptDonated   a predecessor's segments for these files: adopted, done
//   PlanSources    which peers supply the bytes ("plan sources: ")
//   Allocate       the segments, and the chunks they are read in
//                  ("allocate: ")
//   Read           every chunk from storage ("read from storage: ") or
//                  from peers, checked against storage ("read from peers: ")
//   Recheck        the files unchanged while read ("recheck: ")
//   Seal           the segments sealed, the checkpoint built ("seal: ")
//   Dedupe         an identical resident copy returned instead, or tensors
//                  held elsewhere shared ("dedupe: "); registered resident
// A phase that fails returns its error with the phase's name prepended
// (the prefixes above; the code is the phase's). Everything a load holds
// (the files, the metadata charge, the segments) is owned by the loader
// until the checkpoint takes it, so a failed load frees all of it.
//
// Not thread-safe; owned by the thread that loads. Read fans out to
// read_threads / peer_streams threads and joins them before it returns.
class CheckpointLoader {
 public:
  // `options` is borrowed and outlives the loader.
  CheckpointLoader(std::string path, const CheckpointLoadOptions& options);

  CheckpointLoader(const CheckpointLoader&) = delete;
  CheckpointLoader& operator=(const CheckpointLoader&) = delete;

  ~CheckpointLoader();

  // Runs the phases. Call once.
  absl::StatusOr<std::shared_ptr<const Checkpoint>> Load();

 private:
  absl::Status Open();
  absl::Status Charge();
  // The resident checkpoint of the same files, or null.
  std::shared_ptr<const Checkpoint> ShareResident();
  void Layout();
  // The checkpoint over a predecessor's segments for these files, or null
  // (none, or refused: logged, and the files are read).
  std::shared_ptr<const Checkpoint> AdoptDonated();
  absl::Status PlanSources();
  absl::Status Allocate();
  absl::Status ReadFromStorage();
  absl::Status ReadFromPeers();
  absl::Status Recheck();
  absl::Status Seal();
  absl::StatusOr<std::shared_ptr<const Checkpoint>> Dedupe();
  // FilesKey of the files, computed once.
  const std::string& files_key();

  // Constant after construction.
  const std::string path_;
  const CheckpointLoadOptions& options_;
  const UnconfinedFileOpener unconfined_;
  const FileOpener& opener_;  // options_.files, else unconfined_

  // Own synchronization (the reader threads count into it).
  LoadSourceReport local_report_;  // where counts go without options_.report
  LoadTally tally_;

  // Phase state, filled phase by phase; only the loading thread (and the
  // reader threads Read joins) touch it.
  CheckpointFiles files_;                          // Open
  std::unique_ptr<MemoryCharge> metadata_charge_;  // Charge; the checkpoint takes it
  std::string files_key_;                          // files_key()
  LoadLayout layout_;                              // Layout; Read sets the digests
  PeerPlan plan_;                                  // PlanSources
  std::vector<std::unique_ptr<Segment>> segments_;  // Allocate; sealed by Seal
  ChunkPlan chunks_;                               // Allocate
  LoadProgressInfo sources_;                       // Read: where the bytes came from
  std::map<std::string, uint64_t> kept_by_peer_;   // Read
  bool shareable_ = true;                          // Recheck: status unchanged
  std::shared_ptr<Checkpoint> fresh_;              // Seal
  // PlanSources (its memory attached by Allocate): this load's offer to
  // peers loading the same files, closed before Seal (or, on failure,
  // before the segments go).
  std::shared_ptr<LoadingCopy> own_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_STORE_CHECKPOINT_LOADER_H_
