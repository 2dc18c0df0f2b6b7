#include "client/convert.h"

#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "proto/convert/dtype_convert.h"

namespace weightd {
namespace {

template <typename Repeated>
std::vector<std::string> Strings(const Repeated& r) {
  return std::vector<std::string>(r.begin(), r.end());
}

// The stats fields that are plain counters, in DaemonStats' order.
void CopyCounters(const v1::StatsResponse& r, DaemonStats* s) {
  *s = DaemonStats{r.models(),     r.segments(),    r.bytes_resident(), r.materializations(),
                   r.materialization_bytes(), r.cache_hits(), r.cache_misses(),
                   r.leases_open(), r.bytes_served(), r.fetches(), r.applies(), r.adapters(),
                   r.reserve_ready_bytes(), r.reserve_target_bytes(), r.bytes_read()};
  s->checkpoint_bytes_logical = r.checkpoint_bytes_logical();
  s->checkpoint_bytes_resident = r.checkpoint_bytes_resident();
  s->pushes = r.pushes();
  s->publishes = r.publishes();
  s->publish_bytes = r.publish_bytes();
  s->publish_seconds = r.publish_seconds();
  s->publish_sessions = r.publish_sessions();
  s->publish_staging_prepared = r.publish_staging_prepared();
  s->publish_staging_allocated = r.publish_staging_allocated();
  s->publish_staging_ahead_bytes = r.publish_staging_ahead_bytes();
  s->published_bytes_logical = r.published_bytes_logical();
  s->published_bytes_resident = r.published_bytes_resident();
  s->load_bytes_storage = r.load_bytes_storage();
  s->load_bytes_peers = r.load_bytes_peers();
  s->bytes_sent_to_peers = r.bytes_sent_to_peers();
  s->source_bytes = r.source_bytes();
  s->source_requests = r.source_requests();
  s->source_retries = r.source_retries();
  s->source_failures = r.source_failures();
  s->push_bytes = r.push_bytes();
  s->pinned_bytes = r.pinned_bytes();
}

// Memory and GPUs: pages, huge pages, CUDA.
void CopyMemory(const v1::StatsResponse& r, DaemonStats* s) {
  s->segment_bytes_4k = r.segment_bytes_4k();
  s->segment_bytes_thp = r.segment_bytes_thp();
  s->segment_bytes_hugetlb = r.segment_bytes_hugetlb();
  s->huge_page_fallbacks = r.huge_page_fallbacks();
  s->huge_pages = r.huge_pages();
  s->hugetlb_pages_total = r.hugetlb_pages_total();
  s->hugetlb_pages_free = r.hugetlb_pages_free();
  s->shmem_thp = r.shmem_thp();
  s->cuda_built = r.cuda_built();
  s->gpus_unavailable = r.gpus_unavailable();
  for (const v1::GpuDevice& g : r.gpus()) {
    s->gpus.push_back(GpuInfo{g.uuid(), g.name(), g.pci_bus_id(), g.memory_bytes(), g.ordinal(),
                              g.compute_major(), g.compute_minor(), g.pageable_memory_access(),
                              g.host_register(), g.host_register_read_only(),
                              g.unavailable()});
  }
}

}  // namespace

absl::StatusOr<DType> DTypeFromDaemon(v1::DType d) {
  std::optional<DType> dtype = DTypeFromProto(d);
  if (!dtype.has_value()) {
    return absl::InternalError(absl::StrCat("daemon sent unknown dtype ", static_cast<int>(d)));
  }
  return *dtype;
}

ModelInfo ToModelInfo(const v1::ModelInfo& m) {
  ModelInfo out;
  out.name = m.name();
  out.path = m.path();
  out.generation = m.generation();
  out.tensor_count = m.tensor_count();
  out.total_bytes = m.total_bytes();
  out.segment_bytes_4k = m.segment_bytes_4k();
  out.segment_bytes_thp = m.segment_bytes_thp();
  out.segment_bytes_hugetlb = m.segment_bytes_hugetlb();
  out.weights_id = m.weights_id();
  out.files = Strings(m.files());
  out.adapters = Strings(m.adapters());
  out.report = Strings(m.report());
  out.readers = Strings(m.readers());
  for (const v1::TensorInfo& t : m.tensors()) {
    ModelTensor mt;
    mt.name = t.name();
    auto d = DTypeFromDaemon(t.dtype());
    mt.dtype = d.ok() ? *d : DType::kU8;
    mt.shape.assign(t.shape().begin(), t.shape().end());
    if (t.digest().size() == 16) std::memcpy(mt.digest.bytes.data(), t.digest().data(), 16);
    mt.sources = Strings(t.sources());
    mt.patched_by = Strings(t.patched_by());
    out.tensors.push_back(std::move(mt));
  }
  return out;
}

AdapterInfo ToAdapterInfo(const v1::AdapterInfo& a) {
  AdapterInfo out;
  out.name = a.name();
  out.path = a.path();
  out.format = a.format();
  out.tensor_count = a.tensor_count();
  out.bytes = a.bytes();
  out.ignored = Strings(a.ignored());
  out.readers = Strings(a.readers());
  return out;
}

PublishOutcome ToPublishOutcome(const v1::PublishResult& r) {
  PublishOutcome o;
  o.model = r.model();
  o.generation = r.generation();
  o.weights_id = r.weights_id();
  o.tensors = r.tensors();
  o.changed = r.changed();
  o.bytes = r.bytes();
  o.bytes_stored = r.bytes_stored();
  o.bytes_shared = r.bytes_shared();
  o.shared_with = Strings(r.shared_with());
  o.adapters = Strings(r.adapters());
  return o;
}

DaemonStats ToDaemonStats(const v1::StatsResponse& r) {
  DaemonStats s;
  CopyCounters(r, &s);
  for (const v1::PeerTransportStats& t : r.peer_transports()) {
    s.peer_transports.push_back({t.peer(), t.transport(), t.bytes(), t.failures(), t.seconds()});
  }
  for (const v1::PeerTransfer& t : r.peer_transfers()) {
    s.peer_transfers.push_back({t.peer(), t.bytes(), t.failures()});
  }
  CopyMemory(r, &s);
  return s;
}

PeersInfo ToPeersInfo(const v1::PeersResponse& r) {
  PeersInfo out;
  out.advertise = r.advertise();
  out.peer_dns = r.peer_dns();
  out.dns_error = r.dns_error();
  out.poll_seconds = r.poll_seconds();
  for (const v1::PeerInfo& p : r.peers()) {
    PeerInfo info{p.address(), p.reachable(), p.error(), p.last_seen_unix_ms(),
                  p.polled_unix_ms(), {}};
    for (const v1::PeerModel& m : p.models()) {
      info.models.push_back({m.name(), m.generation(), m.weights_id()});
    }
    out.peers.push_back(std::move(info));
  }
  return out;
}

GenerationEvent ToGenerationEvent(const v1::GenerationEvent& e) {
  GenerationEvent ev;
  ev.model = e.model();
  ev.generation = e.generation();
  ev.adapters = Strings(e.adapters());
  ev.weights_id = e.weights_id();
  return ev;
}

absl::StatusOr<v1::LoadSource> ParseSource(const std::string& source) {
  if (source == "auto" || source.empty()) return v1::LOAD_SOURCE_AUTO;
  if (source == "storage") return v1::LOAD_SOURCE_STORAGE;
  if (source == "peers") return v1::LOAD_SOURCE_PEERS;
  return absl::InvalidArgumentError(
      absl::StrCat("--source: expected auto, storage or peers, got \"", source, "\""));
}

}  // namespace weightd
