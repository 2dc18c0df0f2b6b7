// What each weightctl verb does (verbs.h): check its words, call the
// daemon through the C++ client, print the answer on stdout (progress on
// stderr). weightctl.cc picks the verb and prints the errors.
#include "client/cli/verbs.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/fd.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace weightd::weightctl {

namespace {

absl::StatusOr<int64_t> ParseInt(const std::string& flag, const std::string& text) {
  int64_t v;
  if (!absl::SimpleAtoi(text, &v)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", text, "\" is not an integer"));
  }
  return v;
}

std::string HumanBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", b, units[u]);
}

std::string ShapeString(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

absl::Status NeedPositional(const Args& a, size_t n, const char* usage) {
  if (a.positional.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("usage: weightctl ", usage));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Args> ParseArgs(const std::vector<std::string>& words,
                               const std::vector<std::string>& value_flags,
                               const std::vector<std::string>& switch_flags) {
  Args out;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    if (!absl::StartsWith(w, "--")) {
      out.positional.push_back(w);
      continue;
    }
    std::string name = w, value;
    bool inline_value = false;
    if (size_t eq = w.find('='); eq != std::string::npos) {
      name = w.substr(0, eq);
      value = w.substr(eq + 1);
      inline_value = true;
    }
    if (std::find(switch_flags.begin(), switch_flags.end(), name) != switch_flags.end()) {
      out.switches[name] = true;
      continue;
    }
    if (std::find(value_flags.begin(), value_flags.end(), name) == value_flags.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", name));
    }
    if (!inline_value) {
      if (i + 1 >= words.size()) return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
      value = words[++i];
    }
    out.flags[name] = value;
  }
  return out;
}

absl::Status CmdHealth(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 0, "health"));
  WD_RETURN_IF_ERROR(c.Health());
  std::printf("SERVING\n");
  // Serving, with a GPU out of use (a sticky CUDA error): one line each.
  // Best effort: a caller not allowed Stats still gets SERVING.
  if (absl::StatusOr<DaemonStats> s = c.Stats(); s.ok()) {
    for (const GpuInfo& g : s->gpus) {
      if (!g.unavailable.empty()) {
        std::printf("gpu %s unavailable: %s\n", g.uuid.c_str(), g.unavailable.c_str());
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// `flag` G (G >= 1) into *out when given; *out untouched otherwise.
absl::Status ParseGenerationFlag(const Args& a, const char* flag, uint64_t* out) {
  if (!a.Has(flag)) return absl::OkStatus();
  WD_ASSIGN_OR_RETURN(int64_t g, ParseInt(flag, a.Get(flag)));
  if (g < 1) return absl::InvalidArgumentError(absl::StrCat(flag, " must be >= 1"));
  *out = static_cast<uint64_t>(g);
  return absl::OkStatus();
}

// Progress of a long transfer on stderr: a bar redrawn in place on a
// terminal, else one line per tenth ("loading m: 30% (1.2 GiB of 4 GiB)").
class ProgressLine {
 public:
  ProgressLine(const char* verb, std::string name, bool tty)
      : verb_(verb), name_(std::move(name)), tty_(tty) {}
  void Report(uint64_t done, uint64_t total) {
    double frac = total ? static_cast<double>(done) / total : 1.0;
    if (tty_) {
      int width = 30, filled = static_cast<int>(frac * width);
      std::fprintf(stderr, "\r[%s%s] %5.1f%%  %s / %s", std::string(filled, '#').c_str(),
                   std::string(width - filled, ' ').c_str(), frac * 100,
                   HumanBytes(done).c_str(), HumanBytes(total).c_str());
      std::fflush(stderr);
    } else if (static_cast<int>(frac * 10) > last_decile_) {
      last_decile_ = static_cast<int>(frac * 10);
      std::fprintf(stderr, "%s %s: %.0f%% (%s of %s)\n", verb_, name_.c_str(), frac * 100,
                   HumanBytes(done).c_str(), HumanBytes(total).c_str());
    }
  }

 private:
  const char* verb_;
  std::string name_;
  bool tty_;
  int last_decile_ = -1;
};

}  // namespace

absl::Status CmdLoad(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 2, "load NAME PATH [--profile FILE]"));
  std::string profile;
  if (a.Has("--profile")) {
    WD_ASSIGN_OR_RETURN(profile, ReadFileToString(a.Get("--profile"), 64ull << 20));
  }
  const bool tty = ::isatty(STDERR_FILENO);
  ProgressLine line("loading", a.positional[0], tty);
  absl::Time start = absl::Now();
  LoadProgressUpdate last;
  auto progress = [&](const LoadProgressUpdate& p) {
    last = p;
    if (!p.done) line.Report(p.bytes_done, p.bytes_total);
  };
  std::vector<std::string> readers;
  if (a.Has("--readers")) readers.push_back(a.Get("--readers"));
  const std::string source = a.Has("--source") ? a.Get("--source") : "auto";
  auto info = c.Load(a.positional[0], a.positional[1], profile, progress, readers, source);
  if (tty) std::fprintf(stderr, "\n");
  if (!info.ok()) return info.status();
  double secs = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("loaded %s: %llu tensors, %s in %.2f s (%.2f GB/s), generation %llu\n",
              info->name.c_str(), static_cast<unsigned long long>(info->tensor_count),
              HumanBytes(info->total_bytes).c_str(), secs,
              secs > 0 ? info->total_bytes / secs / 1e9 : 0.0,
              static_cast<unsigned long long>(info->generation));
  if (last.bytes_from_peers > 0) {
    std::printf("from peers %s: %s; from storage: %s\n", absl::StrJoin(last.peers, ",").c_str(),
                HumanBytes(last.bytes_from_peers).c_str(),
                HumanBytes(last.bytes_from_storage).c_str());
    // What carried each peer's bytes: "peer transports: A=ucx B=grpc".
    std::vector<std::string> by;
    for (size_t i = 0; i < last.peers.size() && i < last.peer_transports.size(); ++i) {
      if (!last.peer_transports[i].empty()) {
        by.push_back(absl::StrCat(last.peers[i], "=", last.peer_transports[i]));
      }
    }
    if (!by.empty()) std::printf("peer transports: %s\n", absl::StrJoin(by, " ").c_str());
  }
  for (const std::string& line : info->report) std::printf("%s\n", line.c_str());
  return absl::OkStatus();
}

absl::Status CmdUnload(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 1, "unload NAME"));
  WD_RETURN_IF_ERROR(c.Unload(a.positional[0]));
  std::printf("unloaded %s\n", a.positional[0].c_str());
  return absl::OkStatus();
}

absl::Status CmdList(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 0, "list"));
  WD_ASSIGN_OR_RETURN(auto models, c.List());
  for (const ModelInfo& m : models) {
    std::printf("%s\tgeneration=%llu\ttensors=%llu\tbytes=%llu\tpath=%s\n", m.name.c_str(),
                static_cast<unsigned long long>(m.generation),
                static_cast<unsigned long long>(m.tensor_count),
                static_cast<unsigned long long>(m.total_bytes), m.path.c_str());
  }
  return absl::OkStatus();
}

absl::Status CmdInfo(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 1, "info NAME"));
  WD_ASSIGN_OR_RETURN(ModelInfo m, c.GetModel(a.positional[0]));
  std::printf("model: %s\npath: %s\ngeneration: %llu\ntensors: %llu\nbytes: %llu\n",
              m.name.c_str(), m.path.c_str(), static_cast<unsigned long long>(m.generation),
              static_cast<unsigned long long>(m.tensor_count),
              static_cast<unsigned long long>(m.total_bytes));
  std::printf("segment_bytes: 4k=%llu thp=%llu hugetlb=%llu\n",
              static_cast<unsigned long long>(m.segment_bytes_4k),
              static_cast<unsigned long long>(m.segment_bytes_thp),
              static_cast<unsigned long long>(m.segment_bytes_hugetlb));
  std::printf("weights_id: %s\n", m.weights_id.c_str());
  for (const std::string& f : m.files) std::printf("file: %s\n", f.c_str());
  std::printf("adapters: %s\n", m.adapters.empty() ? "(none)" : absl::StrJoin(m.adapters, " ").c_str());
  for (const std::string& line : m.report) std::printf("report: %s\n", line.c_str());
  if (!m.readers.empty()) std::printf("readers: %s\n", absl::StrJoin(m.readers, ",").c_str());
  for (const ModelTensor& t : m.tensors) {
    std::string from;
    if (!(t.sources.size() == 1 && t.sources[0] == t.name)) {
      from = absl::StrCat("\tfrom=", t.sources.empty() ? "(new)" : absl::StrJoin(t.sources, ","));
    }
    std::string by = t.patched_by.empty() ? "" : absl::StrCat("\tpatched_by=", absl::StrJoin(t.patched_by, ","));
    std::printf("tensor: %s\t%s\t%s\t%s%s%s\n", t.name.c_str(),
                std::string(DTypeName(t.dtype)).c_str(), ShapeString(t.shape).c_str(),
                t.digest.Hex().c_str(), from.c_str(), by.c_str());
  }
  return absl::OkStatus();
}

absl::Status CmdVerify(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 1, "verify NAME"));
  WD_ASSIGN_OR_RETURN(auto r, c.Verify(a.positional[0]));
  // What Verify checks: the bytes in memory against the digests recorded
  // when they were loaded (from storage, or from peers: docs/DESIGN.md
  // §8.4, what a fleet trusts a peer for), not storage itself.
  std::printf("verified %s: %llu tensors, %s match the digests recorded at load (memory "
              "checked, not storage)\n",
              a.positional[0].c_str(),
              static_cast<unsigned long long>(r.first), HumanBytes(r.second).c_str());
  return absl::OkStatus();
}

// One "peer:" line per peer (reachable or why not, seconds since it last
// answered), then one "model:" line per model it holds and one
// "transport:" line per transport its bytes came over to this daemon (as
// `weightctl stats` peer_transport lines; only for callers Stats answers).
absl::Status CmdPeers(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 0, "peers"));
  WD_ASSIGN_OR_RETURN(PeersInfo info, c.Peers());
  const absl::StatusOr<DaemonStats> stats = c.Stats();
  if (!info.advertise.empty()) std::printf("advertise: %s\n", info.advertise.c_str());
  if (!info.peer_dns.empty()) {
    std::printf("peer_dns: %s%s\n", info.peer_dns.c_str(),
                info.dns_error.empty() ? "" : absl::StrCat("\terror=", info.dns_error).c_str());
  }
  const int64_t now = absl::ToUnixMillis(absl::Now());
  for (const PeerInfo& p : info.peers) {
    std::string seen = p.last_seen_unix_ms == 0
                           ? "never"
                           : absl::StrFormat("%.1fs ago", (now - p.last_seen_unix_ms) / 1000.0);
    std::printf("peer: %s\t%s\tlast_seen=%s\tmodels=%zu%s\n", p.address.c_str(),
                p.reachable ? "reachable" : "unreachable", seen.c_str(), p.models.size(),
                p.reachable ? "" : absl::StrCat("\terror=", p.error).c_str());
    for (const PeerModelInfo& m : p.models) {
      std::printf("model: %s\t%s\tgeneration=%llu\tweights_id=%s\n", p.address.c_str(),
                  m.name.c_str(), (unsigned long long)m.generation, m.weights_id.c_str());
    }
    if (!stats.ok()) continue;
    for (const DaemonStats::PeerTransportStats& t : stats->peer_transports) {
      if (t.peer != p.address) continue;
      std::printf("transport: %s\t%s\tbytes=%llu\tGB/s=%.2f\tfailures=%llu\n", t.peer.c_str(),
                  t.transport.c_str(), (unsigned long long)t.bytes,
                  t.seconds > 0 ? t.bytes / t.seconds / 1e9 : 0.0,
                  (unsigned long long)t.failures);
    }
  }
  return absl::OkStatus();
}

absl::Status CmdStats(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 0, "stats"));
  WD_ASSIGN_OR_RETURN(DaemonStats s, c.Stats());
  std::printf(
      "models: %llu\nsegments: %llu\nbytes_resident: %llu\nmaterializations: %llu\n"
      "materialization_bytes: %llu\ncache_hits: %llu\ncache_misses: %llu\nleases_open: %llu\n"
      "bytes_served: %llu\nfetches: %llu\napplies: %llu\nadapters: %llu\n"
      "reserve_ready_bytes: %llu\nreserve_target_bytes: %llu\nbytes_read: %llu\n"
      "checkpoint_bytes_logical: %llu\ncheckpoint_bytes_resident: %llu\n",
      (unsigned long long)s.models, (unsigned long long)s.segments,
      (unsigned long long)s.bytes_resident, (unsigned long long)s.materializations,
      (unsigned long long)s.materialization_bytes, (unsigned long long)s.cache_hits,
      (unsigned long long)s.cache_misses, (unsigned long long)s.leases_open,
      (unsigned long long)s.bytes_served, (unsigned long long)s.fetches,
      (unsigned long long)s.applies, (unsigned long long)s.adapters,
      (unsigned long long)s.reserve_ready_bytes, (unsigned long long)s.reserve_target_bytes,
      (unsigned long long)s.bytes_read,
      (unsigned long long)s.checkpoint_bytes_logical,
      (unsigned long long)s.checkpoint_bytes_resident);
  std::printf("publishes: %llu\npublish_bytes: %llu\npublish_seconds: %.3f\npublish_sessions: %llu\n",
              (unsigned long long)s.publishes, (unsigned long long)s.publish_bytes,
              s.publish_seconds, (unsigned long long)s.publish_sessions);
  std::printf("publish_staging_prepared: %llu\npublish_staging_allocated: %llu\n"
              "publish_staging_ahead_bytes: %llu\n",
              (unsigned long long)s.publish_staging_prepared,
              (unsigned long long)s.publish_staging_allocated,
              (unsigned long long)s.publish_staging_ahead_bytes);
  std::printf("published_bytes_logical: %llu\npublished_bytes_resident: %llu\n",
              (unsigned long long)s.published_bytes_logical,
              (unsigned long long)s.published_bytes_resident);
  std::printf("load_bytes_storage: %llu\nload_bytes_peers: %llu\nbytes_sent_to_peers: %llu\n",
              (unsigned long long)s.load_bytes_storage, (unsigned long long)s.load_bytes_peers,
              (unsigned long long)s.bytes_sent_to_peers);
  std::printf("source_bytes: %llu\nsource_requests: %llu\nsource_retries: %llu\n"
              "source_failures: %llu\n",
              (unsigned long long)s.source_bytes, (unsigned long long)s.source_requests,
              (unsigned long long)s.source_retries, (unsigned long long)s.source_failures);
  for (const DaemonStats::PeerTransfer& t : s.peer_transfers) {
    std::printf("peer_transfer: %s\tbytes=%llu\tfailures=%llu\n", t.peer.c_str(),
                (unsigned long long)t.bytes, (unsigned long long)t.failures);
  }
  for (const DaemonStats::PeerTransportStats& t : s.peer_transports) {
    std::printf("peer_transport: %s\t%s\tbytes=%llu\tseconds=%.3f\tGB/s=%.2f\tfailures=%llu\n",
                t.peer.c_str(), t.transport.c_str(), (unsigned long long)t.bytes, t.seconds,
                t.seconds > 0 ? t.bytes / t.seconds / 1e9 : 0.0, (unsigned long long)t.failures);
  }
  std::printf("pushes: %llu\npush_bytes: %llu\npinned_bytes: %llu\ngpus: %zu\n",
              (unsigned long long)s.pushes, (unsigned long long)s.push_bytes,
              (unsigned long long)s.pinned_bytes, s.gpus.size());
  std::printf(
      "huge_pages: %s\nsegment_bytes_4k: %llu\nsegment_bytes_thp: %llu\n"
      "segment_bytes_hugetlb: %llu\nhuge_page_fallbacks: %llu\nhugetlb_pages_total: %llu\n"
      "hugetlb_pages_free: %llu\nshmem_thp: %s\n",
      s.huge_pages.c_str(), (unsigned long long)s.segment_bytes_4k,
      (unsigned long long)s.segment_bytes_thp, (unsigned long long)s.segment_bytes_hugetlb,
      (unsigned long long)s.huge_page_fallbacks, (unsigned long long)s.hugetlb_pages_total,
      (unsigned long long)s.hugetlb_pages_free, s.shmem_thp.c_str());
  return absl::OkStatus();
}

// One line per GPU the daemon found, or why none ("no GPU: REASON"); a GPU
// a sticky CUDA error took out ends its line with "unavailable: WHY".
absl::Status CmdGpus(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 0, "gpus"));
  WD_ASSIGN_OR_RETURN(DaemonStats s, c.Stats());
  if (s.gpus.empty()) {
    std::printf("no GPU: %s\n", s.gpus_unavailable.c_str());
    return absl::OkStatus();
  }
  for (const GpuInfo& g : s.gpus) {
    std::string features;
    if (g.pageable_memory_access) features += " pageable-memory-access";
    if (g.host_register) features += " host-register";
    if (g.host_register_read_only) features += " host-register-read-only";
    std::printf("gpu:\t%s\t%s\t%s\tsm_%d%d\t%s\t#%d\t%s%s%s\n", g.uuid.c_str(),
                g.name.c_str(), g.pci_bus_id.c_str(), g.compute_major, g.compute_minor,
                HumanBytes(g.memory_bytes).c_str(), g.ordinal,
                features.empty() ? "-" : features.c_str() + 1,
                g.unavailable.empty() ? "" : "\tunavailable: ", g.unavailable.c_str());
  }
  return absl::OkStatus();
}

namespace {

absl::Status WriteSafetensors(const std::string& path, const ShardSet& set) {
  std::vector<SafetensorsWriteEntry> entries;
  std::set<absl::string_view> names;
  for (const TensorView& t : set.tensors()) {
    // A safetensors file names each tensor once; a header with a name twice
    // would not describe the data written (the daemon refuses such requests,
    // this keeps an older or broken one from making an invalid file).
    if (!names.insert(t.name).second) {
      return absl::InternalError(absl::StrCat("the daemon sent tensor \"", absl::CHexEscape(t.name),
                                              "\" twice; not writing ", path));
    }
    entries.push_back(SafetensorsWriteEntry{t.name, t.dtype, t.shape, t.length});
  }
  std::string header = BuildSafetensorsHeader(entries);
  std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("creating ", tmp));
  absl::Status s = WriteFull(fd.get(), header.data(), header.size());
  for (const TensorView& t : set.tensors()) {
    if (!s.ok()) break;
    s = WriteFull(fd.get(), t.data, t.length);
  }
  if (s.ok() && ::fsync(fd.get()) != 0) s = ErrnoStatus(errno, "fsync");
  fd.Reset();
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = ErrnoStatus(errno, absl::StrCat("renaming to ", path));
  }
  if (!s.ok()) ::unlink(tmp.c_str());
  return Annotate(s, absl::StrCat("writing ", path));
}

// --world/--rank or --mesh/--coord (default: one rank), then --placements
// with one entry per mesh dim.
absl::Status ParseFetchMesh(const Args& a, FetchOptions& opt) {
  bool world_form = a.Has("--world") || a.Has("--rank");
  bool mesh_form = a.Has("--mesh") || a.Has("--coord");
  if (world_form && mesh_form) {
    return absl::InvalidArgumentError("give either --world/--rank or --mesh/--coord, not both");
  }
  if (world_form) {
    WD_ASSIGN_OR_RETURN(int64_t world, ParseInt("--world", a.Get("--world", "1")));
    WD_ASSIGN_OR_RETURN(int64_t rank, ParseInt("--rank", a.Get("--rank", "0")));
    if (world < 1) return absl::InvalidArgumentError(absl::StrCat("--world must be >= 1, got ", world));
    opt.mesh = MeshCoord{{world}, {rank}};
  } else if (mesh_form) {
    if (!a.Has("--mesh") || !a.Has("--coord")) {
      return absl::InvalidArgumentError("--mesh and --coord go together");
    }
    WD_ASSIGN_OR_RETURN(opt.mesh.shape, ParseMeshShape(a.Get("--mesh")));
    WD_ASSIGN_OR_RETURN(opt.mesh.coord, ParseCoord(a.Get("--coord")));
  }
  WD_RETURN_IF_ERROR(opt.mesh.Validate());
  if (a.Has("--placements")) {
    WD_ASSIGN_OR_RETURN(opt.placements, ParsePlacements(a.Get("--placements")));
    if (opt.placements->size() != opt.mesh.shape.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--placements \"", a.Get("--placements"), "\" has ", opt.placements->size(),
          " entries but the mesh has ", opt.mesh.shape.size(), " dims"));
    }
  }
  return absl::OkStatus();
}

// --transport (default shm) and --device, which only cuda takes.
absl::Status ParseFetchTransport(const Args& a, FetchOptions& opt) {
  std::string transport = a.Get("--transport", "shm");
  if (transport == "shm") {
    opt.transport = Transport::kShm;
  } else if (transport == "grpc") {
    opt.transport = Transport::kGrpc;
  } else if (transport == "push") {
    opt.transport = Transport::kPush;
  } else if (transport == "cuda") {
    opt.transport = Transport::kCuda;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--transport: expected shm, grpc, push or cuda, got \"", transport, "\""));
  }
  if (a.Has("--device")) {
    if (opt.transport != Transport::kCuda) {
      return absl::InvalidArgumentError("--device goes with --transport cuda");
    }
    WD_ASSIGN_OR_RETURN(int64_t dev, ParseInt("--device", a.Get("--device")));
    if (dev < 0 || dev > 1024) return absl::InvalidArgumentError("--device: a CUDA device index");
    opt.cuda_device = static_cast<int>(dev);
  }
  return absl::OkStatus();
}

// Every fetch flag but --out, checked in the order they are listed.
absl::StatusOr<FetchOptions> ParseFetchOptions(const Args& a) {
  FetchOptions opt;
  opt.model = a.positional[0];
  WD_RETURN_IF_ERROR(ParseFetchMesh(a, opt));
  WD_ASSIGN_OR_RETURN(opt.dtype, ParseRequestDType(a.Get("--dtype", "keep")));
  WD_RETURN_IF_ERROR(ParseFetchTransport(a, opt));
  WD_RETURN_IF_ERROR(ParseGenerationFlag(a, "--generation", &opt.generation));
  WD_RETURN_IF_ERROR(ParseGenerationFlag(a, "--changed-since", &opt.changed_since));
  if (a.Has("--names")) {
    for (absl::string_view n : absl::StrSplit(a.Get("--names"), ',')) {
      if (!n.empty()) opt.names.emplace_back(n);
    }
  }
  opt.verify_digests = a.switches.count("--verify") > 0;
  if (a.switches.count("--cast-on-fetch") > 0 && a.switches.count("--merge-on-push") > 0) {
    return absl::InvalidArgumentError("--cast-on-fetch and --merge-on-push exclude each other");
  }
  opt.cast_on_push = a.switches.count("--cast-on-fetch") == 0;
  if (a.switches.count("--merge-on-push") > 0) opt.merge_on_push = true;
  return opt;
}

}  // namespace

absl::Status CmdFetch(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 1, "fetch NAME [...] --out FILE"));
  if (!a.Has("--out")) return absl::InvalidArgumentError("fetch needs --out FILE");
  WD_ASSIGN_OR_RETURN(const FetchOptions opt, ParseFetchOptions(a));
  const std::string transport = a.Get("--transport", "shm");
  absl::Time start = absl::Now();
  WD_ASSIGN_OR_RETURN(std::unique_ptr<ShardSet> set, c.Fetch(opt));
  double secs = absl::ToDoubleSeconds(absl::Now() - start);
  uint64_t bytes = 0;
  for (const TensorView& t : set->tensors()) bytes += t.length;
  WD_RETURN_IF_ERROR(WriteSafetensors(a.Get("--out"), *set));
  std::printf("fetched %zu tensors (%s) of %s generation %llu, rank %lld of %lld, via %s in %.3f s -> %s\n",
              set->tensors().size(), HumanBytes(bytes).c_str(), opt.model.c_str(),
              static_cast<unsigned long long>(set->generation()),
              static_cast<long long>(opt.mesh.FlatRank()),
              static_cast<long long>(opt.mesh.WorldSize()), transport.c_str(), secs,
              a.Get("--out").c_str());
  return set->Release();
}

absl::Status CmdAdapter(Client& c, const Args& a) {
  if (a.positional.empty()) {
    return absl::InvalidArgumentError("usage: weightctl adapter load|list|unload ...");
  }
  const std::string& sub = a.positional[0];
  if (sub == "load") {
    if (a.positional.size() != 3) {
      return absl::InvalidArgumentError("usage: weightctl adapter load NAME PATH [--format F] [--strict]");
    }
    std::vector<std::string> readers;
    if (a.Has("--readers")) readers.push_back(a.Get("--readers"));
    WD_ASSIGN_OR_RETURN(AdapterInfo info,
                        c.LoadAdapter(a.positional[1], a.positional[2], a.Get("--format", "auto"),
                                      a.switches.count("--strict") > 0, readers,
                                      a.Get("--source", "auto")));
    std::printf("loaded adapter %s (%s): patches %llu parameters, %s\n", info.name.c_str(),
                info.format.c_str(), static_cast<unsigned long long>(info.tensor_count),
                HumanBytes(info.bytes).c_str());
    if (!info.ignored.empty()) {
      std::printf("ignored keys (not understood; --strict makes them an error):\n");
      for (const std::string& k : info.ignored) std::printf("  %s\n", k.c_str());
    }
    return absl::OkStatus();
  }
  if (sub == "list") {
    if (a.positional.size() != 1) return absl::InvalidArgumentError("usage: weightctl adapter list");
    WD_ASSIGN_OR_RETURN(auto list, c.ListAdapters());
    for (const AdapterInfo& i : list) {
      std::printf("%s\tformat=%s\tparameters=%llu\tbytes=%llu\tpath=%s\n", i.name.c_str(),
                  i.format.c_str(), static_cast<unsigned long long>(i.tensor_count),
                  static_cast<unsigned long long>(i.bytes), i.path.c_str());
    }
    return absl::OkStatus();
  }
  if (sub == "unload") {
    if (a.positional.size() != 2) return absl::InvalidArgumentError("usage: weightctl adapter unload NAME");
    WD_RETURN_IF_ERROR(c.UnloadAdapter(a.positional[1]));
    std::printf("unloaded adapter %s\n", a.positional[1].c_str());
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown adapter verb \"", sub, "\""));
}

absl::Status CmdApply(Client& c, const Args& a) {
  if (a.positional.empty()) {
    return absl::InvalidArgumentError("usage: weightctl apply MODEL [ADAPTER[:STRENGTH] ...]");
  }
  std::vector<AdapterStrength> stack;
  for (size_t i = 1; i < a.positional.size(); ++i) {
    const std::string& spec = a.positional[i];
    AdapterStrength s;
    size_t colon = spec.rfind(':');
    s.name = spec.substr(0, colon);
    if (colon != std::string::npos) {
      std::string value = spec.substr(colon + 1);
      if (!absl::SimpleAtof(value, &s.strength) || !std::isfinite(s.strength)) {
        return absl::InvalidArgumentError(absl::StrCat("bad strength \"", value, "\" in \"", spec, "\""));
      }
    }
    if (s.name.empty()) return absl::InvalidArgumentError(absl::StrCat("empty adapter name in \"", spec, "\""));
    stack.push_back(std::move(s));
  }
  uint64_t expect = 0;
  WD_RETURN_IF_ERROR(ParseGenerationFlag(a, "--expect-generation", &expect));
  WD_ASSIGN_OR_RETURN(GenerationEvent ev, c.Apply(a.positional[0], stack, expect));
  std::printf("%s generation %llu: %s\n", ev.model.c_str(), static_cast<unsigned long long>(ev.generation),
              ev.adapters.empty() ? "base (no adapters)" : absl::StrJoin(ev.adapters, " ").c_str());
  return absl::OkStatus();
}

namespace {

// --transport (shm or grpc), --expect-generation and --timeout.
absl::StatusOr<PublishOptions> ParsePublishOptions(const Args& a) {
  PublishOptions options;
  if (a.Has("--transport")) {
    const std::string t = a.Get("--transport");
    if (t == "shm") {
      options.transport = Transport::kShm;
    } else if (t == "grpc") {
      options.transport = Transport::kGrpc;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("publish --transport \"", t, "\": use shm or grpc"));
    }
  }
  WD_RETURN_IF_ERROR(ParseGenerationFlag(a, "--expect-generation", &options.expect_generation));
  if (a.Has("--timeout")) {
    WD_ASSIGN_OR_RETURN(int64_t t, ParseInt("--timeout", a.Get("--timeout")));
    if (t < 1 || t > 86400) return absl::InvalidArgumentError("--timeout must be 1 to 86400 seconds");
    options.timeout = absl::Seconds(t);
  }
  return options;
}

// A safetensors file mapped read-only, its tensors pointing into the map.
struct MappedSafetensors {
  UniqueFd fd;
  MappedRegion map;
  std::vector<PublishTensor> tensors;
};

absl::StatusOr<MappedSafetensors> MapSafetensors(const std::string& path) {
  MappedSafetensors out;
  out.fd = UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!out.fd.valid()) {
    return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(out.fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) return absl::InvalidArgumentError(absl::StrCat(path, ": not a safetensors file"));
  WD_ASSIGN_OR_RETURN(out.map,
                      MappedRegion::Map(out.fd.get(), size, MappedRegion::Mode::kReadOnly));
  const char* bytes = reinterpret_cast<const char*>(out.map.data());
  auto header_len = ParseSafetensorsPrefix(absl::string_view(bytes, 8), size);
  if (!header_len.ok()) return Annotate(header_len.status(), path);
  auto header = ParseSafetensorsHeader(absl::string_view(bytes + 8, *header_len), size);
  if (!header.ok()) return Annotate(header.status(), path);
  for (const SafetensorsEntry& e : header->tensors) {
    PublishTensor t;
    t.name = e.name;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.data = reinterpret_cast<const uint8_t*>(bytes) + header->data_offset + e.begin;
    t.length = e.end - e.begin;
    out.tensors.push_back(std::move(t));
  }
  return out;
}

}  // namespace

absl::Status CmdPublish(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(
      a, 2,
      "publish MODEL FILE.safetensors [--expect-generation G] [--timeout SECONDS] "
      "[--transport shm|grpc]"));
  WD_ASSIGN_OR_RETURN(PublishOptions options, ParsePublishOptions(a));
  WD_ASSIGN_OR_RETURN(const MappedSafetensors file, MapSafetensors(a.positional[1]));
  const bool tty = ::isatty(STDERR_FILENO);
  ProgressLine line("publishing", a.positional[0], tty);
  options.progress = [&](uint64_t done, uint64_t total) { line.Report(done, total); };
  absl::Time start = absl::Now();
  auto r = c.Publish(a.positional[0], file.tensors, options);
  if (tty) std::fprintf(stderr, "\n");
  if (!r.ok()) return r.status();
  const std::string shared =
      r->bytes_shared == 0 ? ""
                           : absl::StrCat(" (", HumanBytes(r->bytes_shared), " shared with ",
                                          absl::StrJoin(r->shared_with, ", "), ")");
  std::printf("published %s generation %llu: %llu tensors, %llu changed, %s sent, %s stored%s, "
              "%.2f s, weights_id %s%s%s\n",
              r->model.c_str(), static_cast<unsigned long long>(r->generation),
              static_cast<unsigned long long>(r->tensors),
              static_cast<unsigned long long>(r->changed), HumanBytes(r->bytes).c_str(),
              HumanBytes(r->bytes_stored).c_str(), shared.c_str(),
              absl::ToDoubleSeconds(absl::Now() - start),
              r->weights_id.c_str(), r->adapters.empty() ? "" : ", adapters ",
              absl::StrJoin(r->adapters, " ").c_str());
  return absl::OkStatus();
}

absl::Status CmdWatch(Client& c, const Args& a) {
  WD_RETURN_IF_ERROR(NeedPositional(a, 1, "watch MODEL [--count N]"));
  int64_t count = 0;
  if (a.Has("--count")) {
    WD_ASSIGN_OR_RETURN(count, ParseInt("--count", a.Get("--count")));
    if (count < 1) return absl::InvalidArgumentError("--count must be >= 1");
  }
  int64_t seen = 0;
  return c.Watch(a.positional[0], false, [&](const GenerationEvent& ev) {
    std::printf("%s generation %llu: %s\n", ev.model.c_str(),
                static_cast<unsigned long long>(ev.generation),
                ev.adapters.empty() ? "base (no adapters)" : absl::StrJoin(ev.adapters, " ").c_str());
    std::fflush(stdout);
    return count == 0 || ++seen < count;
  });
}

}  // namespace weightd::weightctl
