#include "server/store/checkpoint_loader.h"

#include <sys/stat.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"
#include "server/store/storage_read.h"

namespace weightd {
namespace {

std::vector<std::string> PathsOf(const CheckpointFiles& files) {
  std::vector<std::string> paths;
  for (const CheckpointFile& f : files.files) paths.push_back(f.path());
  return paths;
}

bool SameTime(const struct timespec& a, const struct timespec& b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Checkpoint>> LoadCheckpoint(
    const std::string& path, const CheckpointLoadOptions& options) {
  CheckpointLoader loader(path, options);
  return loader.Load();
}

CheckpointLoader::CheckpointLoader(std::string path, const CheckpointLoadOptions& options)
    : path_(std::move(path)),
      options_(options),
      opener_(options.files != nullptr ? *options.files : unconfined_),
      tally_(options.progress, options.report != nullptr ? options.report : &local_report_) {}

CheckpointLoader::~CheckpointLoader() {
  // No peer copies from the segments once they go.
  if (own_ != nullptr) own_->Close();
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> CheckpointLoader::Load() {
  const Cancellation* cancel = options_.cancel;
  WD_RETURN_IF_ERROR_CTX(Open(), "open");
  WD_RETURN_IF_ERROR_CTX(Charge(), "charge");
  if (std::shared_ptr<const Checkpoint> resident = ShareResident()) return resident;
  Layout();
  if (std::shared_ptr<const Checkpoint> adopted = AdoptDonated()) return adopted;
  WD_RETURN_IF_ERROR_CTX(CancelledStatus(cancel), "plan sources");
  WD_RETURN_IF_ERROR_CTX(PlanSources(), "plan sources");
  WD_RETURN_IF_ERROR_CTX(Allocate(), "allocate");
  if (plan_.holders.empty() && !plan_.swarm) {
    WD_RETURN_IF_ERROR_CTX(ReadFromStorage(), "read from storage");
  } else {
    WD_RETURN_IF_ERROR_CTX(ReadFromPeers(), "read from peers");
  }
  // Peers read it as a resident checkpoint from now on (or not at all).
  if (own_ != nullptr) own_->Close();
  WD_RETURN_IF_ERROR_CTX(CancelledStatus(cancel), "recheck");
  WD_RETURN_IF_ERROR_CTX(Recheck(), "recheck");
  WD_RETURN_IF_ERROR_CTX(Seal(), "seal");
  absl::StatusOr<std::shared_ptr<const Checkpoint>> checkpoint = Dedupe();
  if (!checkpoint.ok()) return Annotate(checkpoint.status(), "dedupe");
  return checkpoint;
}

absl::Status CheckpointLoader::Open() {
  WD_ASSIGN_OR_RETURN(files_, OpenCheckpointFiles(opener_, path_, options_.opened_files));
  // Every read of them from now on ends when the load is cancelled.
  for (CheckpointFile& f : files_.files) f.opened.cancel = options_.cancel;
  return CancelledStatus(options_.cancel);
}

absl::Status CheckpointLoader::Charge() {
  // The per-tensor bookkeeping counts against the budget like the bytes: a
  // small file of very many tensors must not take unaccounted memory.
  uint64_t metadata_bytes = 0;
  for (const CheckpointFile& f : files_.files) {
    for (const SafetensorsEntry& e : f.header.tensors) {
      metadata_bytes += TensorMetadataBytes(e.name, e.shape.size());
    }
  }
  WD_ASSIGN_OR_RETURN(metadata_charge_,
                      options_.memory->Charge(metadata_bytes, absl::StrCat("metadata of ",
                                                                           files_.tensors,
                                                                           " tensors")));
  return absl::OkStatus();
}

const std::string& CheckpointLoader::files_key() {
  if (files_key_.empty()) files_key_ = FilesKey(files_.files);
  return files_key_;
}

std::shared_ptr<const Checkpoint> CheckpointLoader::ShareResident() {
  // Files already resident (the same files under another model's name or
  // profile) are shared, not read again; the metadata charge goes to the
  // caller, for what it builds per model. The files were opened through
  // the caller's confinement, so only what it may read is shared.
  if (options_.resident == nullptr) return nullptr;
  std::shared_ptr<const Checkpoint> resident = options_.resident->Find(files_key());
  if (resident == nullptr) return nullptr;
  ReportDone(options_.progress, resident->total_bytes(), resident->tensors().size());
  *options_.shared_charge = std::move(metadata_charge_);
  LogEvent(LogLevel::kInfo, "load_shared",
           {{"path", path_}, {"files", absl::StrCat(files_.files.size())},
            {"bytes", absl::StrCat(resident->total_bytes())}});
  return resident;
}

void CheckpointLoader::Layout() {
  layout_ = LayOut(files_, options_.segment_target_bytes);
  tally_.SetTotals(layout_.bytes_total, files_.tensors);
}

std::shared_ptr<const Checkpoint> CheckpointLoader::AdoptDonated() {
  // Segments a predecessor daemon handed over for these very files are
  // adopted instead of read, once they check out.
  if (options_.donated == nullptr) return nullptr;
  std::optional<DonatedCheckpoint> d = options_.donated->Take(files_key());
  if (!d.has_value()) return nullptr;
  const AdoptOptions adopt{.memory = options_.memory,
                           .segment_target_bytes = options_.segment_target_bytes,
                           .verify = options_.donated->verify(),
                           .threads = options_.read_threads};
  absl::StatusOr<AdoptedSegments> adopted = weightd::AdoptDonated(std::move(*d), layout_, adopt);
  if (!adopted.ok()) {
    options_.donated->CountRefused();
    LogEvent(LogLevel::kWarning, "handover_segments_refused",
             {{"path", path_}, {"error", adopted.status().ToString()},
              {"action", "reading the files instead"}});
    return nullptr;
  }
  auto checkpoint = std::make_shared<const Checkpoint>(
      path_, PathsOf(files_), std::move(adopted->tensors), std::move(adopted->segments),
      std::move(metadata_charge_), layout_.file_info);
  options_.donated->CountAdopted();
  ReportDone(options_.progress, layout_.bytes_total, files_.tensors);
  if (options_.resident != nullptr) options_.resident->Add(files_key(), checkpoint);
  LogEvent(LogLevel::kInfo, "load_adopted",
           {{"path", path_}, {"segments", absl::StrCat(layout_.segment_sizes.size())},
            {"bytes", absl::StrCat(layout_.bytes_total)},
            {"verify", AdoptVerifyName(options_.donated->verify())}});
  return checkpoint;
}

absl::Status CheckpointLoader::PlanSources() {
  // Peers holding the same files supply the bytes (checked as they are
  // read), before any memory is taken for them.
  if (options_.source == LoadSource::kStorage) return absl::OkStatus();
  if (options_.source == LoadSource::kAuto && options_.peers != nullptr &&
      options_.resident != nullptr && options_.offer_while_loading != nullptr &&
      layout_.bytes_total > 0) {
    // Seen loading by peers before they are asked (and while storage is
    // sampled): loads that start together find each other at once.
    std::vector<uint64_t> length;
    for (const CheckpointFile& f : files_.files) length.push_back(f.data_length());
    own_ = options_.resident->loading().Add(CheckpointKeyOf(files_),
                                            *options_.offer_while_loading, std::move(length));
  }
  const StorageReader storage(opener_, files_.files, tally_);
  WD_ASSIGN_OR_RETURN(plan_, PlanPeers(path_, options_, files_, layout_, storage, tally_));
  if (!plan_.swarm && own_ != nullptr) {
    own_->Close();
    own_.reset();
  }
  return absl::OkStatus();
}

absl::Status CheckpointLoader::Allocate() {
  for (uint64_t size : layout_.segment_sizes) {
    // Not prefaulted here: one thread allocating and mapping every page up
    // front took over half the load; each reader populates its own chunk.
    WD_ASSIGN_OR_RETURN(std::unique_ptr<Segment> seg,
                        options_.memory->Allocate(size, {.purpose = "checkpoint"}));
    segments_.push_back(std::move(seg));
  }
  std::vector<uint8_t*> file_data;
  for (const CheckpointFile& f : files_.files) {
    file_data.push_back(segments_[f.segment_index]->mutable_data() + f.segment_offset);
  }
  chunks_ = PlanChunks(files_.files, layout_, std::move(file_data),
                       std::max<uint64_t>(1, options_.read_chunk_bytes));
  if (own_ != nullptr) {
    // Peers loading the same files now may read what this load reads from
    // storage, as it lands.
    own_->Attach(std::vector<const uint8_t*>(chunks_.file_data.begin(), chunks_.file_data.end()));
  }
  return absl::OkStatus();
}

absl::Status CheckpointLoader::ReadFromStorage() {
  // Every data section in chunks, in parallel, each tensor digested as
  // soon as its last chunk lands.
  const StorageReader storage(opener_, files_.files, tally_);
  DigestAsRead digest(layout_, chunks_);
  WD_RETURN_IF_ERROR(storage.ReadAll(chunks_, options_.read_threads, &digest));
  if (digest.digested() != layout_.tensors.size()) {
    return absl::InternalError(absl::StrCat("digested ", digest.digested(), " of ",
                                            layout_.tensors.size(), " tensors"));
  }
  sources_.bytes_from_storage = layout_.bytes_total;
  return absl::OkStatus();
}

absl::Status CheckpointLoader::ReadFromPeers() {
  const StorageReader storage(opener_, files_.files, tally_);
  PeerRead read(path_, options_, plan_, files_.files, layout_, chunks_, storage, tally_,
                own_.get());
  WD_RETURN_IF_ERROR(read.Run());
  sources_ = read.sources();
  kept_by_peer_ = read.kept_by_peer();
  return absl::OkStatus();
}

absl::Status CheckpointLoader::Recheck() {
  // A file replaced or rewritten while we read it would give torn tensors.
  // Any other change of its status (a ctime that moved: a write that put
  // the mtime back, a chmod) keeps this copy from being shared: later loads
  // read the files again.
  for (const CheckpointFile& f : files_.files) {
    WD_ASSIGN_OR_RETURN(struct stat now, opener_.Stat(f.opened));
    if (now.st_size != f.st().st_size || !SameTime(now.st_mtim, f.st().st_mtim)) {
      return absl::DataLossError(absl::StrCat(f.path(), " changed while it was being loaded"));
    }
    shareable_ = shareable_ && SameTime(now.st_ctim, f.st().st_ctim);
  }
  return absl::OkStatus();
}

absl::Status CheckpointLoader::Seal() {
  // Sealing keeps each segment's mapping (read-only now) with the pages the
  // readers wrote still mapped. Where it has to remap (kernels before 5.1),
  // the new mapping's page tables are filled on all reader threads instead
  // of by one MAP_POPULATE.
  const uint64_t piece = std::max<uint64_t>(1, options_.read_chunk_bytes);
  std::vector<std::pair<const uint8_t*, uint64_t>> ranges;
  for (std::unique_ptr<Segment>& seg : segments_) {
    WD_RETURN_IF_ERROR(seg->Seal(/*populate=*/false));
    if (seg->kept_mapping()) continue;
    for (uint64_t off = 0; off < seg->size(); off += piece) {
      ranges.emplace_back(seg->data() + off, std::min(piece, seg->size() - off));
    }
  }
  WD_RETURN_IF_ERROR(ParallelFor(nullptr, ranges.size(), options_.read_threads, [&](size_t i) {
    PopulateForRead(ranges[i].first, ranges[i].second);
    return absl::OkStatus();
  }));
  std::vector<SegmentPtr> sealed;
  for (std::unique_ptr<Segment>& seg : segments_) sealed.push_back(SegmentPtr(std::move(seg)));
  segments_.clear();
  std::vector<StoredTensor>& tensors = layout_.tensors;
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].buffer = sealed[layout_.tensor_segment[i]];
  // The peers' bytes this load keeps; the rest of what they sent stays
  // counted as discarded.
  for (const auto& [peer, bytes] : kept_by_peer_) tally_.KeepPeerBytes(peer, bytes);
  ReportDone(options_.progress, layout_.bytes_total, files_.tensors, &sources_);
  fresh_ = std::make_shared<Checkpoint>(path_, PathsOf(files_), std::move(tensors),
                                        std::move(sealed), std::move(metadata_charge_),
                                        std::move(layout_.file_info));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> CheckpointLoader::Dedupe() {
  if (options_.resident != nullptr) {
    // The same bytes at other paths (a copy): what was just read is freed.
    // (Not registered under these files: a hand-over sends each resident
    // entry's segments, and would send that copy's twice.)
    if (std::shared_ptr<const Checkpoint> same = FindIdenticalCopy(*options_.resident, *fresh_)) {
      *options_.shared_charge = fresh_->TakeMetadataCharge();
      LogEvent(LogLevel::kInfo, "load_deduplicated",
               {{"path", path_}, {"same_as", same->path()},
                {"bytes_freed", absl::StrCat(fresh_->total_bytes())}});
      fresh_.reset();
      return same;
    }
  }
  if (options_.find_held) {
    WD_ASSIGN_OR_RETURN(fresh_, ShareHeldTensors(path_, options_.find_held, options_.memory,
                                                 options_.read_threads, std::move(fresh_)));
  }
  std::shared_ptr<const Checkpoint> checkpoint = std::move(fresh_);
  if (options_.resident != nullptr && shareable_) options_.resident->Add(files_key(), checkpoint);
  return checkpoint;
}

}  // namespace weightd
