// Fuzzes LoadAdapter (server/adapter/adapter.h): adapter files come from
// users, and the loader parses their safetensors header, their PEFT
// adapter_config.json and the tensors' bytes (F64/F32/F16/BF16/FP8 -> fp32).
//
// Input layout: byte 0 picks the format (bits 0-1: auto, peft, kohya, dense)
// and the layout on disk ((byte 0 >> 2) % 3):
//   0  the rest is one .safetensors file, alone in its directory;
//   1  the rest is split at its first NUL byte into an adapter_config.json
//      and a .safetensors file beside it (a PEFT file with a sibling config);
//   2  the same split, as a PEFT directory (adapter_config.json +
//      adapter_model.safetensors).
// JSON never needs a raw NUL, and a safetensors file starts with its length
// prefix, so a seed "config \0 file" splits where it should.
//
// Every loaded patch is then applied to its whole shape and to a half of it
// (small shapes only), against a zero base, so the patches' slicing runs on
// the factors the parser built. The files live in one temporary directory
// per process (on tmpfs when possible), rewritten on each input.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/shard.h"
#include "server/adapter/adapter.h"
#include "server/adapter/patch.h"

namespace weightd {
namespace {

#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

// Patches with more elements than this are not applied (the box math is the
// same; only the time would grow).
constexpr int64_t kMaxApplyElements = 1 << 14;

struct Paths {
  std::string root;
  std::string single;   // <root>/single/adapter.safetensors
  std::string sibling;  // <root>/sibling/w.safetensors
  std::string sibling_config;
  std::string peft_dir;  // <root>/peft
  std::string peft_config;
  std::string peft_weights;
};

void MakeDir(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0) {
    std::perror(path.c_str());
    std::abort();
  }
}

// tmpfs when there is one: rewriting files with O_TRUNC on a disk file
// system (ext4's auto_da_alloc flushes them on close) costs milliseconds per
// input.
std::string MakeTempRoot() {
  std::vector<std::string> bases = {"/dev/shm"};
  const char* tmp = std::getenv("TMPDIR");
  bases.push_back(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp");
  for (const std::string& base : bases) {
    std::string tmpl = base + "/weightd-adapter-fuzz-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) return tmpl;
  }
  std::perror("mkdtemp");
  std::abort();
}

const Paths& TempPaths() {
  static const Paths* const kPaths = [] {
    auto* p = new Paths;
    p->root = MakeTempRoot();
    MakeDir(p->root + "/single");
    MakeDir(p->root + "/sibling");
    MakeDir(p->root + "/peft");
    p->single = p->root + "/single/adapter.safetensors";
    p->sibling = p->root + "/sibling/w.safetensors";
    p->sibling_config = p->root + "/sibling/adapter_config.json";
    p->peft_dir = p->root + "/peft";
    p->peft_config = p->root + "/peft/adapter_config.json";
    p->peft_weights = p->root + "/peft/adapter_model.safetensors";
    // libFuzzer ends through exit() when its time is up; after a crash the
    // directory stays (a few small files).
    std::atexit([] {
      const Paths& q = *kPaths;
      for (const std::string& f :
           {q.single, q.sibling, q.sibling_config, q.peft_config, q.peft_weights}) {
        ::unlink(f.c_str());
      }
      for (const char* d : {"/single", "/sibling", "/peft", ""}) {
        ::rmdir((q.root + d).c_str());
      }
    });
    return p;
  }();
  return *kPaths;
}

void WriteFile(const std::string& path, absl::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::perror(path.c_str());
    std::abort();
  }
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n <= 0) {
      std::perror(path.c_str());
      std::abort();
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  ::close(fd);
}

// numel, or -1 when a dim is negative or the product exceeds `limit`.
int64_t BoundedNumel(const std::vector<int64_t>& shape, int64_t limit) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d == 0) return 0;
    if (n > limit / d) return -1;
    n *= d;
  }
  return n;
}

void ApplyOnBox(const TensorPatch& patch, const std::vector<int64_t>& shape, const ShardBox& box) {
  const int64_t box_numel = box.NumElements();
  FUZZ_CHECK(box_numel >= 0 && box_numel <= kMaxApplyElements);
  std::vector<float> acc(static_cast<size_t>(box_numel) + 1, 1.0f);
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const int64_t cols = rows == 0 ? 0 : BoundedNumel(shape, kMaxApplyElements) / rows;
  // A zero base; a patch that asks for rows outside the tensor is a bug.
  const BaseRowReader base = [&](int64_t row_begin, int64_t row_end, float* out) {
    FUZZ_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= rows);
    std::memset(out, 0, static_cast<size_t>((row_end - row_begin) * cols) * sizeof(float));
    return absl::OkStatus();
  };
  (void)patch.Apply(box, shape, 0.5f, base, acc.data());
  (void)patch.CacheKey();
}

void ApplyPatch(const TensorPatch& patch) {
  const std::vector<int64_t> shape = patch.shape();
  const int64_t numel = BoundedNumel(shape, kMaxApplyElements);
  if (numel < 0) return;
  ShardBox whole;
  whole.offset.assign(shape.size(), 0);
  whole.shape = shape;
  ApplyOnBox(patch, shape, whole);
  // The second half along dim 0 and along the last dim.
  if (shape.empty()) return;
  const MeshCoord mesh{{2}, {1}};
  for (int dim : {0, static_cast<int>(shape.size()) - 1}) {
    const std::vector<Placement> placements = {Placement::Shard(dim)};
    absl::StatusOr<ShardBox> box = PlanShard(shape, mesh, placements);
    FUZZ_CHECK(box.ok());
    ApplyOnBox(patch, shape, *box);
  }
}

// Base names for ResolveKohyaTarget.
const std::vector<std::string>& BaseNames() {
  static const auto* const kNames = new std::vector<std::string>{
      "model.diffusion_model.input_blocks.1.1.proj_in.weight",
      "model.diffusion_model.input_blocks.1.1.proj_in.bias",
      "text_model.encoder.layers.0.self_attn.q_proj.weight",
      "transformer_blocks.0.attn.to_q.weight",
      "transformer.blocks.0.attn.to_q.weight",
      "up.weight",
  };
  return *kNames;
}

void CheckAdapter(const Adapter& a, const std::string& path) {
  FUZZ_CHECK(a.path == path);
  FUZZ_CHECK(a.format != AdapterFormat::kAuto);
  FUZZ_CHECK(!a.entries.empty());
  for (const AdapterEntry& e : a.entries) {
    FUZZ_CHECK(e.patch != nullptr);
    if (e.needs_kohya_resolution) {
      absl::StatusOr<std::string> target = ResolveKohyaTarget(e.target, BaseNames());
      if (target.ok()) FUZZ_CHECK(!target->empty());
    }
    ApplyPatch(*e.patch);
  }
}

}  // namespace
}  // namespace weightd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightd;
  if (size < 1) return 0;
  const Paths& paths = TempPaths();
  static constexpr AdapterFormat kFormats[] = {AdapterFormat::kAuto, AdapterFormat::kPeft,
                                               AdapterFormat::kKohya, AdapterFormat::kDense};
  const AdapterFormat format = kFormats[data[0] & 3];
  const int layout = (data[0] >> 2) % 3;
  const absl::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);

  std::string path;
  if (layout == 0) {
    WriteFile(paths.single, rest);
    path = paths.single;
  } else {
    const size_t nul = rest.find('\0');
    const absl::string_view config = rest.substr(0, nul);
    const absl::string_view weights =
        nul == absl::string_view::npos ? absl::string_view() : rest.substr(nul + 1);
    if (layout == 1) {
      WriteFile(paths.sibling_config, config);
      WriteFile(paths.sibling, weights);
      path = paths.sibling;
    } else {
      WriteFile(paths.peft_config, config);
      WriteFile(paths.peft_weights, weights);
      path = paths.peft_dir;
    }
  }

  absl::StatusOr<std::shared_ptr<const Adapter>> adapter = LoadAdapter(path, format);
  if (!adapter.ok()) {
    // Every file exists, so only malformed content can fail.
    FUZZ_CHECK(adapter.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(*adapter != nullptr);
  CheckAdapter(**adapter, path);
  return 0;
}
