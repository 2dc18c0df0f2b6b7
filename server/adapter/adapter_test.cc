#include "server/adapter/adapter.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/kernels/cast.h"
#include "server/kernels/merge.h"
#include "common/safetensors.h"
#include "common/testing/safetensors_files.h"
#include "gtest/gtest.h"
#include "server/adapter/lora_patch.h"

namespace weightd {
namespace {

::testing::AssertionResult Contains(absl::string_view text, absl::string_view want) {
  if (text.find(want) != absl::string_view::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" lacks \"" << want << "\"";
}

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// ------------------------------------------------------------ file helpers

TestTensor F32(std::string name, std::vector<int64_t> shape, const std::vector<float>& v) {
  return {std::move(name), DType::kF32, std::move(shape), F32Bytes(v)};
}

TestTensor BF16(std::string name, std::vector<int64_t> shape, const std::vector<float>& v) {
  std::string b(v.size() * 2, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = FloatToBFloat16(v[i]);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
  return {std::move(name), DType::kBF16, std::move(shape), std::move(b)};
}

TestTensor I64(std::string name, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {std::move(name), DType::kI64, std::move(shape), std::string(n * 8, '\0')};
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

void WriteSafetensors(const std::string& path, const std::vector<TestTensor>& tensors) {
  WriteFile(path, SafetensorsFileBytes(tensors));
}

std::vector<float> Random(size_t n, uint32_t seed, float stddev = 0.1f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Rounds to bf16-representable values (so products are exact in fp32).
std::vector<float> Bf16Values(std::vector<float> v) {
  for (float& x : v) x = BFloat16ToFloat(FloatToBFloat16(x));
  return v;
}

class AdapterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/adapter_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(absl::StrCat("rm -rf '", dir_, "'").c_str()); }

  std::string Path(const std::string& name) const { return absl::StrCat(dir_, "/", name); }
  std::string MakeDir(const std::string& name) const {
    std::string p = Path(name);
    std::system(absl::StrCat("mkdir -p '", p, "'").c_str());
    return p;
  }
  // A PEFT directory with `config` and `tensors`.
  std::string Peft(const std::string& name, const std::string& config,
                   const std::vector<TestTensor>& tensors) {
    std::string d = MakeDir(name);
    WriteFile(d + "/adapter_config.json", config);
    WriteSafetensors(d + "/adapter_model.safetensors", tensors);
    return d;
  }

  std::string dir_;
};

const AdapterEntry* Find(const Adapter& a, const std::string& target) {
  for (const AdapterEntry& e : a.entries) {
    if (e.target == target) return &e;
  }
  return nullptr;
}

template <typename T>
const T* As(const AdapterEntry* e) {
  return e == nullptr ? nullptr : dynamic_cast<const T*>(e->patch.get());
}

// ------------------------------------------------------------ math helpers

// Full ΔW in double: scale · (B @ A), transposed when asked. [out,in] or [in,out].
std::vector<double> DeltaRef(const std::vector<float>& a, const std::vector<float>& b, int64_t r,
                             int64_t in, int64_t out, double scale, bool transposed) {
  std::vector<double> d(static_cast<size_t>(in * out));
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      double sum = 0;
      for (int64_t k = 0; k < r; ++k) sum += double(b[o * r + k]) * double(a[k * in + i]);
      if (transposed) {
        d[i * out + o] = scale * sum;
      } else {
        d[o * in + i] = scale * sum;
      }
    }
  }
  return d;
}

std::vector<float> Slice(const std::vector<float>& full, int64_t cols, const ShardBox& box) {
  std::vector<float> out;
  for (int64_t i = 0; i < box.shape[0]; ++i) {
    for (int64_t j = 0; j < box.shape[1]; ++j) {
      out.push_back(full[(box.offset[0] + i) * cols + box.offset[1] + j]);
    }
  }
  return out;
}

BaseRowReader Reader(const std::vector<float>& w, int64_t cols) {
  return [&w, cols](int64_t b, int64_t e, float* out) {
    std::memcpy(out, w.data() + b * cols, static_cast<size_t>((e - b) * cols) * sizeof(float));
    return absl::OkStatus();
  };
}

// Applies `p` to the box of base `w` [rows, cols] and compares with
// `want(r, c)` (double) within 1e-5 relative to `mag(r, c)`.
template <typename Want, typename Mag>
void CheckBox(const TensorPatch& p, const std::vector<float>& w, int64_t rows, int64_t cols,
              const ShardBox& box, float strength, Want want, Mag mag) {
  std::vector<float> acc = Slice(w, cols, box);
  std::vector<int64_t> global = {rows, cols};
  ASSERT_TRUE(p.Apply(box, global, strength, Reader(w, cols), acc.data()).ok());
  for (int64_t i = 0; i < box.shape[0]; ++i) {
    for (int64_t j = 0; j < box.shape[1]; ++j) {
      const int64_t r = box.offset[0] + i, c = box.offset[1] + j;
      const double expect = want(r, c);
      const double got = acc[i * box.shape[1] + j];
      ASSERT_LE(std::fabs(got - expect), 1e-5 * (mag(r, c) + 1e-30))
          << "at (" << r << ", " << c << ") box offset " << box.offset[0] << "," << box.offset[1]
          << " got " << got << " want " << expect;
    }
  }
}

std::vector<ShardBox> TestBoxes(int64_t rows, int64_t cols) {
  std::vector<ShardBox> boxes;
  boxes.push_back({{0, 0}, {rows, cols}});  // full
  const int64_t rc = (rows + 3) / 4, cc = (cols + 2) / 3;
  for (int64_t r = 0; r * rc < rows; ++r) {  // row shards (Shard(0) over 4)
    boxes.push_back({{r * rc, 0}, {std::min(rc, rows - r * rc), cols}});
  }
  for (int64_t c = 0; c * cc < cols; ++c) {  // column shards (Shard(1) over 3)
    boxes.push_back({{0, c * cc}, {rows, std::min(cc, cols - c * cc)}});
  }
  boxes.push_back({{1, 2}, {rows / 2, cols / 3}});  // both split
  boxes.push_back({{rows - 1, cols - 2}, {1, 2}});  // corner
  boxes.push_back({{rows / 2, 0}, {0, cols}});      // empty
  return boxes;
}

// LoRA Apply against the double reference: acc = W + strength · ΔW.
void CheckLora(const LoraPatch& p, const std::vector<float>& a, const std::vector<float>& b,
               float strength) {
  const LowRankFactors& f = p.factors();
  const std::vector<int64_t> shape = p.shape();
  const int64_t rows = shape[0], cols = shape[1];
  std::vector<double> delta = DeltaRef(a, b, f.rank, f.in, f.out, 1.0, p.transposed());
  std::vector<double> mag(delta.size());
  // Error scale: |W| + |s|·Σ|B||A|.
  for (int64_t o = 0; o < f.out; ++o) {
    for (int64_t i = 0; i < f.in; ++i) {
      double s = 0;
      for (int64_t k = 0; k < f.rank; ++k)
        s += std::fabs(double(b[o * f.rank + k]) * a[k * f.in + i]);
      mag[p.transposed() ? i * f.out + o : o * f.in + i] = s;
    }
  }
  std::vector<float> w = Random(static_cast<size_t>(rows * cols), 99, 1.0f);
  const double s = double(strength) * p.scale();
  for (const ShardBox& box : TestBoxes(rows, cols)) {
    CheckBox(
        p, w, rows, cols, box, strength,
        [&](int64_t r, int64_t c) { return w[r * cols + c] + s * delta[r * cols + c]; },
        [&](int64_t r, int64_t c) {
          return std::fabs(w[r * cols + c]) + std::fabs(s) * mag[r * cols + c];
        });
  }
}

std::shared_ptr<const LoraPatch> MakeLora(int64_t r, int64_t in, int64_t out, double scale,
                                          bool transposed, std::vector<float>* a,
                                          std::vector<float>* b) {
  *a = Random(static_cast<size_t>(r * in), 1);
  *b = Random(static_cast<size_t>(out * r), 2);
  LowRankFactors f{r, in, out, *a, *b};
  auto p = LoraPatch::Create({Digest{}, "w"}, f, scale, transposed);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

// ------------------------------------------------------------ format names

TEST(AdapterFormatTest, ParsesNamesCaseInsensitively) {
  EXPECT_EQ(*ParseAdapterFormat("auto"), AdapterFormat::kAuto);
  EXPECT_EQ(*ParseAdapterFormat("peft"), AdapterFormat::kPeft);
  EXPECT_EQ(*ParseAdapterFormat("Kohya"), AdapterFormat::kKohya);
  EXPECT_EQ(*ParseAdapterFormat("DENSE"), AdapterFormat::kDense);
  auto bad = ParseAdapterFormat("lycoris");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "lycoris"));
  EXPECT_EQ(AdapterFormatName(AdapterFormat::kKohya), "kohya");
}

// ------------------------------------------------------------ patch math

TEST(LoraPatchTest, ApplyMatchesReferenceOnEveryBox) {
  std::vector<float> a, b;
  auto p = MakeLora(5, 29, 37, 1.6, false, &a, &b);
  EXPECT_EQ(p->shape(), (std::vector<int64_t>{37, 29}));
  CheckLora(*p, a, b, 1.0f);
}

TEST(LoraPatchTest, StrengthScalesDelta) {
  std::vector<float> a, b;
  auto p = MakeLora(3, 17, 11, 0.75, false, &a, &b);
  CheckLora(*p, a, b, 0.5f);
  CheckLora(*p, a, b, -1.3f);
  // Strength 0 leaves the accumulator untouched.
  std::vector<float> acc(11 * 17, 2.5f);
  ASSERT_TRUE(p->Apply({{0, 0}, {11, 17}}, {11, 17}, 0.0f, nullptr, acc.data()).ok());
  for (float x : acc) ASSERT_EQ(x, 2.5f);
}

TEST(LoraPatchTest, TransposedApplyMatchesReferenceOnEveryBox) {
  std::vector<float> a, b;
  auto p = MakeLora(4, 23, 13, 2.0, true, &a, &b);
  EXPECT_EQ(p->shape(), (std::vector<int64_t>{23, 13}));  // [in, out]
  CheckLora(*p, a, b, 1.0f);
  CheckLora(*p, a, b, 0.3f);
}

TEST(LoraPatchTest, TallMatrixSpansSeveralGemmBlocks) {
  // 1 MiB scratch / 1100 columns = 238 rows per block: 600 rows take three.
  std::vector<float> a, b;
  auto p = MakeLora(8, 1100, 600, 0.5, false, &a, &b);
  const int64_t rows = 600, cols = 1100;
  std::vector<float> w = Random(rows * cols, 5, 1.0f);
  std::vector<double> d = DeltaRef(a, b, 8, cols, rows, 0.5, false);
  for (const ShardBox& box : {ShardBox{{0, 0}, {rows, cols}}, ShardBox{{13, 100}, {500, 900}}}) {
    CheckBox(
        *p, w, rows, cols, box, 1.0f,
        [&](int64_t r, int64_t c) { return w[r * cols + c] + d[r * cols + c]; },
        [&](int64_t r, int64_t c) { return std::fabs(w[r * cols + c]) + 1.0; });
  }
}

TEST(LoraPatchTest, TallTransposedAndDoraSpanSeveralBlocks) {
  // Transposed: [in=700, out=1100]; 1 MiB / 1100 columns = 238 rows a block.
  std::vector<float> a, b;
  auto t = MakeLora(4, 700, 1100, 0.25, true, &a, &b);
  const int64_t rows = 700, cols = 1100;
  std::vector<float> w = Random(rows * cols, 6, 1.0f);
  std::vector<double> d = DeltaRef(a, b, 4, rows, cols, 0.25, true);
  for (const ShardBox& box : {ShardBox{{0, 0}, {rows, cols}}, ShardBox{{250, 7}, {449, 1000}}}) {
    CheckBox(
        *t, w, rows, cols, box, 1.0f,
        [&](int64_t r, int64_t c) { return w[r * cols + c] + d[r * cols + c]; },
        [&](int64_t r, int64_t c) { return std::fabs(w[r * cols + c]) + 1.0; });
  }
  // DoRA reads base rows in blocks of 1 MiB / in.
  const int64_t out = 600, in = 1100, r = 3;
  std::vector<float> da = Random(r * in, 31), db = Random(out * r, 32), m = Random(out, 33, 1.0f);
  auto p = DoraPatch::Create({Digest{}, "w"}, LowRankFactors{r, in, out, da, db}, 1.5, m);
  ASSERT_TRUE(p.ok());
  std::vector<float> base = Random(out * in, 34, 1.0f);
  std::vector<double> dd = DeltaRef(da, db, r, in, out, 1.5, false);
  std::vector<double> norm(out);
  for (int64_t o = 0; o < out; ++o) {
    double ss = 0;
    for (int64_t i = 0; i < in; ++i) ss += std::pow(base[o * in + i] + dd[o * in + i], 2);
    norm[o] = std::sqrt(ss);
  }
  for (const ShardBox& box : {ShardBox{{0, 0}, {out, in}}, ShardBox{{100, 550}, {450, 550}}}) {
    CheckBox(
        **p, base, out, in, box, 1.0f,
        [&](int64_t o, int64_t i) { return m[o] / norm[o] * (base[o * in + i] + dd[o * in + i]); },
        [&](int64_t o, int64_t i) {
          return std::fabs(m[o] / norm[o]) * (std::fabs(base[o * in + i]) + 1.0);
        });
  }
}

TEST(LoraPatchTest, RoundsLikePeftMergeBitForBit) {
  // bf16-representable factors: every product is exact in fp32, so the
  // k-ascending fp32 sum, then * scale, then + W is the exact expectation.
  const int64_t r = 8, in = 64, out = 48;
  std::vector<float> a = Bf16Values(Random(r * in, 11, 0.05f));
  std::vector<float> b = Bf16Values(Random(out * r, 12, 0.05f));
  std::vector<float> w = Bf16Values(Random(out * in, 13, 0.5f));
  const double scale = 16.0 / 3.0;
  auto p = LoraPatch::Create({Digest{}, "w"}, LowRankFactors{r, in, out, a, b}, scale, false);
  ASSERT_TRUE(p.ok());
  std::vector<float> acc = w;
  ASSERT_TRUE((*p)->Apply({{0, 0}, {out, in}}, {out, in}, 1.0f, nullptr, acc.data()).ok());
  const float s = static_cast<float>(scale);
  int diffs = 0;
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      float sum = 0.0f;
      for (int64_t k = 0; k < r; ++k) sum += b[o * r + k] * a[k * in + i];
      volatile float delta = sum * s;
      const float want = w[o * in + i] + delta;
      diffs += std::memcmp(&want, &acc[o * in + i], 4) != 0;
    }
  }
  EXPECT_EQ(diffs, 0);
}

// The LoRA update of `box` by a fixed-order reference: for every element,
// Σ_k B[i][k]·A[k][j] summed k ascending with one fused multiply-add per
// term, then · s, then + acc — the order the fused kernel documents. The
// sum's order is ours here, not a BLAS library's.
std::vector<float> FixedOrderLoraUpdate(const std::vector<float>& acc, const ShardBox& box,
                                        const std::vector<float>& a, const std::vector<float>& b,
                                        int64_t r, int64_t in, float s) {
  std::vector<float> out = acc;
  for (int64_t i = 0; i < box.shape[0]; ++i) {
    for (int64_t j = 0; j < box.shape[1]; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < r; ++k) {
        sum = std::fma(b[(box.offset[0] + i) * r + k], a[k * in + box.offset[1] + j], sum);
      }
      volatile float delta = sum * s;
      out[i * box.shape[1] + j] += delta;
    }
  }
  return out;
}

struct FusedCase {
  int64_t r, in, out;
};
constexpr FusedCase kFusedCases[] = {
    {16, 2048, 259}, {16, 77, 1001}, {8, 33, 6}, {1, 31, 5}, {64, 130, 67}};

std::vector<ShardBox> FusedBoxes(int64_t out, int64_t in) {
  return {ShardBox{{0, 0}, {out, in}}, ShardBox{{3, 5}, {out - 4, in - 7}}};
}

std::vector<float> BoxOf(const std::vector<float>& w, int64_t in, const ShardBox& box) {
  std::vector<float> x;
  for (int64_t i = 0; i < box.shape[0]; ++i) {
    for (int64_t j = 0; j < box.shape[1]; ++j) {
      x.push_back(w[(box.offset[0] + i) * in + box.offset[1] + j]);
    }
  }
  return x;
}

TEST(LoraPatchTest, FusedKernelMatchesAFixedOrderReferenceBitForBit) {
  // The row-major layout runs the fused AVX-512 kernel where the CPU has it
  // (elsewhere it goes through cblas_sgemm, whose summation order is the
  // BLAS library's choice: see the next test). Its order is fixed, so its
  // bits are: compared with the same order written out in scalar code.
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "no AVX-512: the fused kernel is not used";
  for (const FusedCase& c : kFusedCases) {
    std::vector<float> a = Random(c.r * c.in, 21), b = Random(c.out * c.r, 22);
    auto plain = LoraPatch::Create({Digest{}, "w"}, LowRankFactors{c.r, c.in, c.out, a, b}, 0.7, false);
    ASSERT_TRUE(plain.ok());
    const float s = EffectiveScale(1.25f, 0.7);
    std::vector<float> w = Random(c.out * c.in, 23, 1.0f);
    for (const ShardBox& box : FusedBoxes(c.out, c.in)) {
      if (box.shape[0] <= 0 || box.shape[1] <= 0) continue;
      std::vector<float> x = BoxOf(w, c.in, box);
      std::vector<float> want = FixedOrderLoraUpdate(x, box, a, b, c.r, c.in, s);
      ASSERT_TRUE((*plain)->Apply(box, {c.out, c.in}, 1.25f, nullptr, x.data()).ok());
      EXPECT_EQ(std::memcmp(x.data(), want.data(), x.size() * 4), 0)
          << "r=" << c.r << " in=" << c.in << " out=" << c.out;
    }
  }
}

// A row range [r0, r0 + rows) of an [out, in] parameter, as a push merges
// it element by element (server/kernels/merge.h, the GPU's MergeElement on the
// CPU), from F32 to F32, in pieces that start anywhere in a row.
std::vector<float> MergeRowsByElements(const std::vector<float>& w, int64_t in, int64_t r0,
                                       int64_t rows, const std::vector<MergeTerm>& terms,
                                       size_t piece) {
  std::vector<float> out(static_cast<size_t>(rows * in));
  const float* src = w.data() + r0 * in;
  for (size_t at = 0; at < out.size(); at += piece) {
    const size_t n = std::min(piece, out.size() - at);
    EXPECT_TRUE(MergeBufferHost(DType::kF32, src + at, DType::kF32, out.data() + at, n, at, r0,
                                in, terms)
                    .ok());
  }
  return out;
}

TEST(LoraPatchTest, ElementTermsMergeInTheFusedKernelsOrderBitForBit) {
  // The GPU's per-element merge (ElementTerm + MergeElement): plain LoRA
  // in the documented fixed order, bit for bit (the same reference the
  // fused AVX-512 kernel is held to), and transposed LoRA the same with
  // A and B's roles swapped; in pieces cut mid-row, on row ranges.
  for (const FusedCase& c : kFusedCases) {
    std::vector<float> a = Random(c.r * c.in, 31), b = Random(c.out * c.r, 32);
    std::vector<float> w = Random(c.out * c.in, 33, 1.0f);
    auto plain =
        LoraPatch::Create({Digest{}, "w"}, LowRankFactors{c.r, c.in, c.out, a, b}, 0.7, false);
    ASSERT_TRUE(plain.ok());
    MergeTerm t;
    ASSERT_TRUE((*plain)->ElementTerm(1.25f, &t));
    EXPECT_EQ(t.kind, MergeTerm::kLowRank);
    EXPECT_EQ(t.s, EffectiveScale(1.25f, 0.7));
    EXPECT_EQ(t.x_len + t.y_len, a.size() + b.size());
    const int64_t r0 = c.out > 4 ? 3 : 0, rows = c.out > 4 ? c.out - 4 : c.out;
    ShardBox box{{r0, 0}, {rows, c.in}};
    std::vector<float> want = FixedOrderLoraUpdate(BoxOf(w, c.in, box), box, a, b, c.r, c.in, t.s);
    for (size_t piece : {size_t{7}, size_t{4096}, want.size()}) {
      std::vector<float> got = MergeRowsByElements(w, c.in, r0, rows, {t}, piece);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
          << "r=" << c.r << " in=" << c.in << " out=" << c.out << " piece " << piece;
    }
    // Transposed: the parameter is [in, out] = (B @ A)^T; with At = A^T
    // and Bt = B^T its rows are those of Bt^T... i.e. ΔW[i][j] = Σ_k
    // A[k][i] B[j][k]: the fixed-order reference over (At as B, Bt as A).
    std::vector<float> at(a.size()), bt(b.size());
    for (int64_t k = 0; k < c.r; ++k) {
      for (int64_t i = 0; i < c.in; ++i) at[i * c.r + k] = a[k * c.in + i];
      for (int64_t j = 0; j < c.out; ++j) bt[k * c.out + j] = b[j * c.r + k];
    }
    auto trans =
        LoraPatch::Create({Digest{}, "w"}, LowRankFactors{c.r, c.in, c.out, a, b}, 0.7, true);
    ASSERT_TRUE(trans.ok());
    ASSERT_TRUE((*trans)->ElementTerm(1.25f, &t));
    std::vector<float> wt = Random(c.in * c.out, 34, 1.0f);
    const int64_t t0 = c.in > 3 ? 2 : 0;  // a row range after row 0
    ShardBox tbox{{t0, 0}, {c.in - t0, c.out}};
    want = FixedOrderLoraUpdate(BoxOf(wt, c.out, tbox), tbox, bt, at, c.r, c.out, t.s);
    std::vector<float> got = MergeRowsByElements(wt, c.out, t0, c.in - t0, {t}, 1000);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
        << "transposed r=" << c.r << " in=" << c.in << " out=" << c.out;
    // And Apply (whichever kernel this CPU runs) agrees within the fp32
    // accumulation bound.
    std::vector<float> applied = BoxOf(wt, c.out, tbox);
    ASSERT_TRUE((*trans)->Apply(tbox, {c.in, c.out}, 1.25f, nullptr, applied.data()).ok());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], applied[i], 1e-5f * (1.0f + std::fabs(applied[i]))) << i;
    }
  }
}

TEST(DensePatchTest, ElementTermsMergeAsApplyDoesBitForBit) {
  // .diff (add, scaled), .set_weight (set, scaled), modules_to_save (copy),
  // stacked on a LoRA term, on a row range of a [5, 2, 3] parameter viewed
  // as [5, 6]; NaN and -0 among the values.
  const std::vector<int64_t> shape = {5, 2, 3};
  std::vector<float> v = Random(30, 41, 1.0f), w = Random(30, 42, 1.0f);
  v[7] = std::nanf("");
  v[8] = -0.0f;
  w[9] = -0.0f;
  for (DensePatch::Mode mode :
       {DensePatch::Mode::kAdd, DensePatch::Mode::kSet, DensePatch::Mode::kSetIgnoringStrength}) {
    auto p = DensePatch::Create({Digest{}, "x"}, shape, v, mode, 0.5);
    ASSERT_TRUE(p.ok());
    MergeTerm t;
    ASSERT_TRUE((*p)->ElementTerm(0.75f, &t));
    EXPECT_EQ(t.v_len, 30u);
    ShardBox box{{1, 0, 0}, {3, 2, 3}};
    std::vector<float> want(w.begin() + 6, w.begin() + 24);
    ASSERT_TRUE((*p)->Apply(box, shape, 0.75f, nullptr, want.data()).ok());
    std::vector<float> got = MergeRowsByElements(w, 6, 1, 3, {t}, 5);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
        << static_cast<int>(mode);
  }
  // A DoRA patch needs whole rows: it has no element term.
  std::vector<float> a, b;
  auto lora = MakeLora(2, 6, 5, 1.0, false, &a, &b);
  auto dora = DoraPatch::Create({Digest{}, "d"}, lora->factors(), 1.0, Random(5, 43, 1.0f));
  ASSERT_TRUE(dora.ok());
  MergeTerm t;
  EXPECT_FALSE((*dora)->ElementTerm(1.0f, &t));
}

TEST(LoraPatchTest, GemmPathAgreesWithTheFixedOrderWithinFp32AccumulationError) {
  // The transposed layout always goes through cblas_sgemm, which may sum
  // the k terms in any order (blocked, split, vectorized: OpenBLAS picks a
  // kernel by CPU, and OPENBLAS_CORETYPE changes the pick). Two orders of
  // a k-term fp32 sum each lie within γ_k·Σ|terms| of the exact sum
  // (γ_k = k·u/(1-k·u), u = 2⁻²⁴; Higham, Accuracy and Stability §3.1), so
  // they differ by at most 2γ_k·Σ|terms|; the scaling and the add round
  // once more each (one ulp of the result). Anything beyond is a bug, not
  // an order.
  constexpr double kU = 1.0 / (1 << 24);
  for (const FusedCase& c : kFusedCases) {
    std::vector<float> a = Random(c.r * c.in, 21), b = Random(c.out * c.r, 22);
    std::vector<float> at(c.in * c.r), bt(c.r * c.out);  // B' = Aᵀ [in, r], A' = Bᵀ [r, out]
    for (int64_t k = 0; k < c.r; ++k) {
      for (int64_t i = 0; i < c.in; ++i) at[i * c.r + k] = a[k * c.in + i];
      for (int64_t o = 0; o < c.out; ++o) bt[k * c.out + o] = b[o * c.r + k];
    }
    auto trans = LoraPatch::Create({Digest{}, "w"}, LowRankFactors{c.r, c.out, c.in, bt, at}, 0.7, true);
    ASSERT_TRUE(trans.ok());
    ASSERT_EQ((*trans)->shape(), (std::vector<int64_t>{c.out, c.in}));
    const float s = EffectiveScale(1.25f, 0.7);
    const double gamma = c.r * kU / (1 - c.r * kU);
    std::vector<float> w = Random(c.out * c.in, 23, 1.0f);
    for (const ShardBox& box : FusedBoxes(c.out, c.in)) {
      if (box.shape[0] <= 0 || box.shape[1] <= 0) continue;
      std::vector<float> y = BoxOf(w, c.in, box);
      std::vector<float> want = FixedOrderLoraUpdate(y, box, a, b, c.r, c.in, s);
      ASSERT_TRUE((*trans)->Apply(box, {c.out, c.in}, 1.25f, nullptr, y.data()).ok());
      int64_t beyond = 0;
      double worst = 0;
      for (int64_t i = 0; i < box.shape[0]; ++i) {
        for (int64_t j = 0; j < box.shape[1]; ++j) {
          double terms = 0;
          for (int64_t k = 0; k < c.r; ++k) {
            terms += std::fabs(double(b[(box.offset[0] + i) * c.r + k]) *
                               a[k * c.in + box.offset[1] + j]);
          }
          const size_t e = static_cast<size_t>(i * box.shape[1] + j);
          const double result = std::max(std::fabs(double(want[e])), std::fabs(double(y[e])));
          const double bound = 2 * gamma * terms * std::fabs(s) * (1 + 2 * kU) +
                               2 * kU * (std::fabs(s) * terms * (1 + gamma)) + 2 * kU * result;
          const double diff = std::fabs(double(y[e]) - double(want[e]));
          worst = std::max(worst, diff / std::max(bound, 1e-300));
          beyond += diff > bound;
        }
      }
      EXPECT_EQ(beyond, 0) << "r=" << c.r << " in=" << c.in << " out=" << c.out
                           << ": worst |diff| / bound = " << worst;
    }
  }
}

TEST(LoraPatchTest, RejectsWrongShapeAndBadBoxes) {
  std::vector<float> a, b;
  auto p = MakeLora(2, 6, 4, 1.0, false, &a, &b);
  std::vector<float> acc(24);
  auto s = p->Apply({{0, 0}, {6, 4}}, {6, 4}, 1.0f, nullptr, acc.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "expects a tensor of shape [4, 6]"));
  s = p->Apply({{3, 0}, {2, 6}}, {4, 6}, 1.0f, nullptr, acc.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "outside"));
  s = p->Apply({{0}, {4}}, {4, 6}, 1.0f, nullptr, acc.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  auto bad = LoraPatch::Create({Digest{}, "w"}, LowRankFactors{2, 6, 4, a, {}}, 1.0, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DoraPatchTest, ApplyMatchesReferenceOnEveryBox) {
  const int64_t r = 3, in = 19, out = 14;
  std::vector<float> a = Random(r * in, 21), b = Random(out * r, 22);
  std::vector<float> m = Random(out, 23, 1.0f);
  for (float& x : m) x = std::fabs(x) + 0.5f;
  const double scale = 2.5;
  auto p = DoraPatch::Create({Digest{}, "w"}, LowRankFactors{r, in, out, a, b}, scale, m);
  ASSERT_TRUE(p.ok()) << p.status();
  std::vector<float> w = Random(out * in, 24, 1.0f);
  for (float strength : {1.0f, 0.4f}) {
    const double s = strength * scale;
    std::vector<double> d = DeltaRef(a, b, r, in, out, s, false);
    std::vector<double> norm(out);
    for (int64_t o = 0; o < out; ++o) {
      double ss = 0;
      for (int64_t i = 0; i < in; ++i) ss += std::pow(w[o * in + i] + d[o * in + i], 2);
      norm[o] = std::sqrt(ss);
    }
    for (const ShardBox& box : TestBoxes(out, in)) {
      CheckBox(
          **p, w, out, in, box, strength,
          [&](int64_t o, int64_t i) { return m[o] / norm[o] * (w[o * in + i] + d[o * in + i]); },
          [&](int64_t o, int64_t i) {
            return m[o] / norm[o] * (std::fabs(w[o * in + i]) + std::fabs(d[o * in + i]) + 1e-3);
          });
    }
  }
  // It needs the base.
  std::vector<float> acc(out * in);
  auto st = (*p)->Apply({{0, 0}, {out, in}}, {out, in}, 1.0f, nullptr, acc.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  BaseRowReader failing = [](int64_t, int64_t, float*) { return absl::DataLossError("gone"); };
  st = (*p)->Apply({{0, 0}, {out, in}}, {out, in}, 1.0f, failing, acc.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
}

TEST(DensePatchTest, SlicesNdBoxesAndScalars) {
  const std::vector<int64_t> shape = {3, 4, 5};
  std::vector<float> v(60);
  for (int i = 0; i < 60; ++i) v[i] = float(i);
  auto add = DensePatch::Create({Digest{}, "x"}, shape, v, DensePatch::Mode::kAdd);
  ASSERT_TRUE(add.ok());
  ShardBox box{{1, 1, 2}, {2, 2, 3}};
  std::vector<float> acc(12, 1.0f);
  ASSERT_TRUE((*add)->Apply(box, shape, 2.0f, nullptr, acc.data()).ok());
  size_t n = 0;
  for (int i = 1; i < 3; ++i)
    for (int j = 1; j < 3; ++j)
      for (int k = 2; k < 5; ++k) EXPECT_EQ(acc[n++], 1.0f + 2.0f * v[i * 20 + j * 5 + k]);
  // 0-d parameter, replaced with strength.
  auto set = DensePatch::Create({Digest{}, "s"}, {}, {3.0f}, DensePatch::Mode::kSet);
  ASSERT_TRUE(set.ok());
  float one = 7.0f;
  ASSERT_TRUE((*set)->Apply({{}, {}}, {}, 0.5f, nullptr, &one).ok());
  EXPECT_EQ(one, 1.5f);
  // Replacement ignoring strength, 1-D row slice.
  auto keep = DensePatch::Create({Digest{}, "k"}, {6}, {1, 2, 3, 4, 5, 6},
                                 DensePatch::Mode::kSetIgnoringStrength);
  ASSERT_TRUE(keep.ok());
  std::vector<float> row(2, 0.0f);
  ASSERT_TRUE((*keep)->Apply({{4}, {2}}, {6}, 0.25f, nullptr, row.data()).ok());
  EXPECT_EQ(row, (std::vector<float>{5, 6}));
  EXPECT_EQ((*keep)->kind(), TensorPatch::Kind::kReplace);
  auto mismatch = DensePatch::Create({Digest{}, "x"}, {2, 2}, {1, 2, 3}, DensePatch::Mode::kAdd);
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PatchCacheKeyTest, DistinguishesSourceTargetKindAndScale) {
  Digest d1 = DigestBytes("a", 1), d2 = DigestBytes("b", 1);
  LowRankFactors f{1, 2, 2, {1, 2}, {3, 4}};
  auto k = [&](Digest d, std::string t, double s, bool tr) {
    return (*LoraPatch::Create({d, t}, f, s, tr))->CacheKey();
  };
  EXPECT_EQ(k(d1, "w", 1.0, false), k(d1, "w", 1.0, false));
  EXPECT_NE(k(d1, "w", 1.0, false), k(d2, "w", 1.0, false));
  EXPECT_NE(k(d1, "w", 1.0, false), k(d1, "v", 1.0, false));
  EXPECT_NE(k(d1, "w", 1.0, false), k(d1, "w", 2.0, false));
  EXPECT_NE(k(d1, "w", 1.0, false), k(d1, "w", 1.0, true));
  auto add = (*DensePatch::Create({d1, "w"}, {2}, {1, 2}, DensePatch::Mode::kAdd))->CacheKey();
  auto set = (*DensePatch::Create({d1, "w"}, {2}, {1, 2}, DensePatch::Mode::kSet))->CacheKey();
  EXPECT_NE(add, set);
  EXPECT_TRUE(Contains(add, d1.Hex()));
}

// ------------------------------------------------------------ PEFT

constexpr char kQ[] = "model.layers.0.self_attn.q_proj";
constexpr char kV[] = "model.layers.0.self_attn.v_proj";

std::vector<TestTensor> PeftPair(const std::string& module, int64_t r, int64_t in, int64_t out,
                                 uint32_t seed, const std::string& prefix = "base_model.model.") {
  return {F32(prefix + module + ".lora_A.weight", {r, in}, Random(r * in, seed)),
          F32(prefix + module + ".lora_B.weight", {out, r}, Random(out * r, seed + 1))};
}

std::vector<TestTensor> Concat(std::vector<TestTensor> a, const std::vector<TestTensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_F(AdapterTest, PeftPlainDirectory) {
  std::string d = Peft("plain", R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                    "target_modules": ["q_proj", "v_proj"]})",
                       Concat(PeftPair(kQ, 4, 16, 12, 1), PeftPair(kV, 4, 16, 8, 3)));
  auto a = LoadAdapter(d, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->format, AdapterFormat::kPeft);
  EXPECT_EQ((*a)->path, d);
  ASSERT_EQ((*a)->entries.size(), 2u);
  const AdapterEntry* q = Find(**a, absl::StrCat(kQ, ".weight"));
  ASSERT_NE(q, nullptr);
  EXPECT_FALSE(q->needs_kohya_resolution);
  auto* lq = As<LoraPatch>(q);
  ASSERT_NE(lq, nullptr);
  EXPECT_EQ(lq->scale(), 2.0);
  EXPECT_EQ(lq->shape(), (std::vector<int64_t>{12, 16}));
  EXPECT_EQ(lq->kind(), TensorPatch::Kind::kAdd);
  EXPECT_TRUE((*a)->ignored_keys.empty());
  EXPECT_EQ((*a)->bytes, (4 * 16 + 12 * 4 + 4 * 16 + 8 * 4) * 4u);
  // The values survive the trip.
  std::vector<float> a_vals = Random(4 * 16, 1), b_vals = Random(12 * 4, 2);
  EXPECT_EQ(lq->factors().a, a_vals);
  EXPECT_EQ(lq->factors().b, b_vals);
  CheckLora(*lq, a_vals, b_vals, 0.7f);

  // The digest is stable and covers the config.
  auto again = LoadAdapter(d, AdapterFormat::kPeft);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->digest, (*a)->digest);
  WriteFile(d + "/adapter_config.json", R"({"r": 4, "lora_alpha": 16})");
  auto changed = LoadAdapter(d, AdapterFormat::kAuto);
  ASSERT_TRUE(changed.ok());
  EXPECT_NE((*changed)->digest, (*a)->digest);
  EXPECT_EQ(As<LoraPatch>(Find(**changed, absl::StrCat(kQ, ".weight")))->scale(), 4.0);
  EXPECT_NE(lq->CacheKey(), Find(**changed, absl::StrCat(kQ, ".weight"))->patch->CacheKey());
}

// Records every file opened; refuses the one named `refused`.
class RecordingOpener final : public FileOpener {
 public:
  absl::StatusOr<OpenedFile> Open(absl::string_view path) const override {
    return Note(std::string(path), files_.Open(path));
  }
  absl::StatusOr<OpenedFile> OpenIn(const OpenedFile& dir, absl::string_view name) const override {
    return Note(absl::StrCat(dir.path, "/", name), files_.OpenIn(dir, name));
  }
  absl::StatusOr<OpenedFile> OpenBeside(const OpenedFile& file,
                                        absl::string_view name) const override {
    return Note(absl::StrCat(file.path.substr(0, file.path.rfind('/')), "/", name),
                files_.OpenBeside(file, name));
  }
  std::string refused;
  mutable std::vector<std::string> asked;

 private:
  absl::StatusOr<OpenedFile> Note(const std::string& p, absl::StatusOr<OpenedFile> f) const {
    asked.push_back(p);
    if (p == refused) return absl::PermissionDeniedError(p);
    return f;
  }
  UnconfinedFileOpener files_;
};

TEST_F(AdapterTest, EveryFileGoesThroughTheOpener) {
  std::string d = Peft("resolved", R"({"r": 4, "lora_alpha": 8})", PeftPair(kQ, 4, 16, 12, 1));
  RecordingOpener opener;
  auto a = LoadAdapter(d, AdapterFormat::kAuto, {.files = &opener});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(opener.asked, (std::vector<std::string>{d, d + "/adapter_config.json",
                                                    d + "/adapter_model.safetensors"}));
  // A refusal of any file fails the load with that status.
  for (const std::string& refused : std::vector<std::string>(opener.asked)) {
    RecordingOpener refusing;
    refusing.refused = refused;
    auto r = LoadAdapter(d, AdapterFormat::kAuto, {.files = &refusing});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << refused;
    EXPECT_NE(std::string(r.status().message()).find(refused), std::string::npos) << r.status();
  }
  // A single file's sibling config goes through it too.
  RecordingOpener single;
  auto f = LoadAdapter(d + "/adapter_model.safetensors", AdapterFormat::kAuto, {.files = &single});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(single.asked, (std::vector<std::string>{d + "/adapter_model.safetensors",
                                                    d + "/adapter_config.json"}));
}

// The patches' bytes are reserved before any tensor is read; a refusal
// fails the load, and the reservation lives as long as the adapter.
TEST_F(AdapterTest, ReservesThePatchBytesBeforeReading) {
  std::string d = Peft("reserved", R"({"r": 4, "lora_alpha": 8})", PeftPair(kQ, 4, 16, 12, 1));
  std::vector<uint64_t> asked;
  auto token = std::make_shared<int>(0);
  auto a = LoadAdapter(d, AdapterFormat::kAuto,
                       {.reserve = [&](uint64_t bytes) -> absl::StatusOr<std::shared_ptr<const void>> {
                         asked.push_back(bytes);
                         return std::shared_ptr<const void>(token);
                       }});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0], (4u * 16 + 12u * 4) * 4);  // lora_A [4, 16] + lora_B [12, 4], fp32
  EXPECT_EQ(asked[0], (*a)->bytes);
  EXPECT_EQ(token.use_count(), 2);
  a->reset();
  EXPECT_EQ(token.use_count(), 1);
  auto refused = LoadAdapter(d, AdapterFormat::kAuto,
                             {.reserve = [&](uint64_t) -> absl::StatusOr<std::shared_ptr<const void>> {
                               return absl::ResourceExhaustedError("budget");
                             }});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(AdapterTest, PeftRsLoraScalesBySqrtRank) {
  std::string d =
      Peft("rs", R"({"r": 16, "lora_alpha": 8, "use_rslora": true})", PeftPair(kQ, 16, 8, 8, 1));
  auto a = LoadAdapter(d, AdapterFormat::kPeft);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_DOUBLE_EQ(As<LoraPatch>(&(*a)->entries[0])->scale(), 8.0 / 4.0);
}

TEST_F(AdapterTest, PeftAlphaPatternFirstMatchInFileOrderWins) {
  // Keys are listed out of alphabetical order: file order must win.
  std::string d = Peft("ap", R"({"r": 4, "lora_alpha": 4,
      "alpha_pattern": {"self_attn.q_proj": 32, "model.layers.0.self_attn.q_proj": 64,
                        "_proj": 100, "layers\\.\\d+\\.mlp\\.up_proj": 12}})",
                       Concat(Concat(PeftPair(kQ, 4, 8, 8, 1), PeftPair(kV, 4, 8, 8, 3)),
                              PeftPair("model.layers.3.mlp.up_proj", 4, 8, 8, 5)));
  auto a = LoadAdapter(d, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(As<LoraPatch>(Find(**a, absl::StrCat(kQ, ".weight")))->scale(), 8.0);
  // "_proj" is not on a module boundary: v_proj keeps lora_alpha.
  EXPECT_EQ(As<LoraPatch>(Find(**a, absl::StrCat(kV, ".weight")))->scale(), 1.0);
  EXPECT_EQ(As<LoraPatch>(Find(**a, "model.layers.3.mlp.up_proj.weight"))->scale(), 3.0);
}

TEST_F(AdapterTest, PeftRankPatternGivesPerModuleRank) {
  std::string cfg = R"({"r": 8, "lora_alpha": 16, "rank_pattern": {"v_proj": 2}})";
  std::string d = Peft("rp", cfg, Concat(PeftPair(kQ, 8, 8, 8, 1), PeftPair(kV, 2, 8, 8, 3)));
  auto a = LoadAdapter(d, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(As<LoraPatch>(Find(**a, absl::StrCat(kQ, ".weight")))->scale(), 2.0);
  EXPECT_EQ(As<LoraPatch>(Find(**a, absl::StrCat(kV, ".weight")))->scale(), 8.0);
  // A rank the config does not give the module is rejected.
  std::string bad = Peft("rp_bad", cfg, PeftPair(kQ, 4, 8, 8, 1));
  auto b = LoadAdapter(bad, AdapterFormat::kAuto);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(b.status().message(), "does not match r=8"));
  EXPECT_TRUE(Contains(b.status().message(), "q_proj.lora_A.weight"));
}

TEST_F(AdapterTest, PeftFanInFanOutTransposes) {
  const std::string m = "transformer.h.0.attn.c_attn";
  std::string d = Peft("fifo", R"({"r": 2, "lora_alpha": 4, "fan_in_fan_out": true})",
                       PeftPair(m, 2, 10, 30, 7));
  auto a = LoadAdapter(d, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  auto* p = As<LoraPatch>(Find(**a, m + ".weight"));
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->transposed());
  EXPECT_EQ(p->shape(), (std::vector<int64_t>{10, 30}));  // Conv1D [in, out]
  CheckLora(*p, Random(20, 7), Random(60, 8), 1.0f);
}

TEST_F(AdapterTest, PeftDoraBuildsDoraPatch) {
  std::vector<float> mag = Random(8, 40, 1.0f);
  for (float& x : mag) x = std::fabs(x) + 1;
  auto tensors = PeftPair(kQ, 2, 6, 8, 1);
  tensors.push_back(F32(absl::StrCat("base_model.model.", kQ, ".lora_magnitude_vector"), {8}, mag));
  std::string d = Peft("dora", R"({"r": 2, "lora_alpha": 2, "use_dora": true})", tensors);
  auto a = LoadAdapter(d, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  auto* p = As<DoraPatch>(Find(**a, absl::StrCat(kQ, ".weight")));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->magnitude(), mag);
  EXPECT_EQ(p->scale(), 1.0);
  EXPECT_EQ(p->shape(), (std::vector<int64_t>{8, 6}));

  // use_dora without magnitudes, magnitudes without use_dora, DoRA +
  // fan_in_fan_out, wrong magnitude length.
  auto err = [&](const std::string& name, const std::string& cfg, std::vector<TestTensor> t,
                 const std::string& want) {
    auto r = LoadAdapter(Peft(name, cfg, t), AdapterFormat::kAuto);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_TRUE(Contains(r.status().message(), want)) << name;
  };
  err("d1", R"({"r": 2, "lora_alpha": 2, "use_dora": true})", PeftPair(kQ, 2, 6, 8, 1),
      "lora_magnitude_vector is missing");
  err("d2", R"({"r": 2, "lora_alpha": 2})", tensors, "use_dora is not set");
  err("d3", R"({"r": 2, "lora_alpha": 2, "use_dora": true, "fan_in_fan_out": true})", tensors,
      "fan_in_fan_out");
  auto short_mag = PeftPair(kQ, 2, 6, 8, 1);
  short_mag.push_back(
      F32(absl::StrCat("base_model.model.", kQ, ".lora_magnitude_vector"), {7}, Random(7, 1)));
  err("d4", R"({"r": 2, "lora_alpha": 2, "use_dora": true})", short_mag, "magnitude shape [7]");
}

TEST_F(AdapterTest, PeftModulesToSaveAreReplacements) {
  auto tensors = PeftPair(kQ, 2, 4, 4, 1);
  tensors.push_back(F32("base_model.model.score.weight", {2, 4}, {1, 2, 3, 4, 5, 6, 7, 8}));
  tensors.push_back(
      F32("base_model.model.classifier.modules_to_save.default.dense.bias", {2}, {9, 10}));
  tensors.push_back(F32("base_model.model.lm_head.weight", {2, 2}, {1, 1, 1, 1}));  // not listed
  tensors.push_back(F32("base_model.model.model.norm.alpha", {1}, {3}));            // not LoRA
  std::string d = Peft("mts", R"({"r": 2, "lora_alpha": 2,
      "modules_to_save": ["score", "classifier"]})",
                       tensors);
  auto a = LoadAdapter(d, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  const AdapterEntry* score = Find(**a, "score.weight");
  ASSERT_NE(score, nullptr);
  EXPECT_EQ(score->patch->kind(), TensorPatch::Kind::kReplace);
  std::vector<float> acc(8, -1.0f);
  ASSERT_TRUE(score->patch->Apply({{0, 0}, {2, 4}}, {2, 4}, 0.25f, nullptr, acc.data()).ok());
  EXPECT_EQ(acc, (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}));  // strength ignored
  ASSERT_NE(Find(**a, "classifier.dense.bias"), nullptr);
  EXPECT_EQ(Sorted((*a)->ignored_keys),
            Sorted({"base_model.model.lm_head.weight", "base_model.model.model.norm.alpha"}));
}

TEST_F(AdapterTest, PeftEmbeddingAndLoraBias) {
  std::vector<TestTensor> t = {
      F32("base_model.model.model.embed_tokens.lora_embedding_A", {2, 20}, Random(40, 1)),
      F32("base_model.model.model.embed_tokens.lora_embedding_B", {6, 2}, Random(12, 2))};
  t = Concat(t, PeftPair(kQ, 2, 4, 3, 5));
  t.push_back(F32(absl::StrCat("base_model.model.", kQ, ".lora_B.bias"), {3}, {1, 2, 3}));
  std::string d = Peft("emb", R"({"r": 2, "lora_alpha": 6, "lora_bias": true})", t);
  auto a = LoadAdapter(d, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  auto* e = As<LoraPatch>(Find(**a, "model.embed_tokens.weight"));
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape(), (std::vector<int64_t>{20, 6}));
  CheckLora(*e, Random(40, 1), Random(12, 2), 1.0f);
  auto* bias = As<DensePatch>(Find(**a, absl::StrCat(kQ, ".bias")));
  ASSERT_NE(bias, nullptr);
  std::vector<float> acc(3, 1.0f);
  ASSERT_TRUE(bias->Apply({{0}, {3}}, {3}, 0.5f, nullptr, acc.data()).ok());
  EXPECT_EQ(acc, (std::vector<float>{2.5f, 4.0f, 5.5f}));  // 1 + 0.5·3·b
}

TEST_F(AdapterTest, PeftSingleFileWithAndWithoutSiblingConfig) {
  // No config, no alpha: scale 1 (alpha = r). In-memory spelling with the
  // adapter name, without the base_model.model. prefix.
  std::string f = Path("loose.safetensors");
  WriteSafetensors(f, {F32(absl::StrCat(kQ, ".lora_A.default.weight"), {4, 3}, Random(12, 1)),
                       F32(absl::StrCat(kQ, ".lora_B.default.weight"), {2, 4}, Random(8, 2)),
                       F32(absl::StrCat(kV, ".lora_A.weight"), {4, 3}, Random(12, 3)),
                       F32(absl::StrCat(kV, ".lora_B.weight"), {2, 4}, Random(8, 4)),
                       F32(absl::StrCat(kV, ".alpha"), {}, {8})});
  auto a = LoadAdapter(f, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->format, AdapterFormat::kPeft);
  EXPECT_EQ(As<LoraPatch>(Find(**a, absl::StrCat(kQ, ".weight")))->scale(), 1.0);
  EXPECT_EQ(As<LoraPatch>(Find(**a, absl::StrCat(kV, ".weight")))->scale(), 2.0);

  // The file inside a PEFT directory, named directly, uses its config.
  std::string d = Peft("named", R"({"r": 4, "lora_alpha": 2})", PeftPair(kQ, 4, 3, 2, 1));
  auto b = LoadAdapter(d + "/adapter_model.safetensors", AdapterFormat::kAuto);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(As<LoraPatch>(&(*b)->entries[0])->scale(), 0.5);
}

TEST_F(AdapterTest, PeftConfigErrors) {
  auto pair = PeftPair(kQ, 2, 4, 4, 1);
  struct Case {
    std::string config, want;
  };
  std::vector<Case> cases = {
      {"{not json", "not valid JSON"},
      {"[1, 2]", "not a JSON object"},
      {R"({"peft_type": "IA3"})", "is not \"LORA\""},
      {R"({"r": "eight"})", "\"r\" must be an integer"},
      {R"({"r": 0})", "\"r\" must be an integer >= 1"},
      {R"({"lora_alpha": "x"})", "\"lora_alpha\" must be a number"},
      {R"({"use_rslora": 1})", "\"use_rslora\" must be a boolean"},
      {R"({"bias": "some"})", "is not one of none, all, lora_only"},
      {R"({"alpha_pattern": {"q_proj": "big"}})", "must be a number"},
      {R"({"rank_pattern": {"(": 2}})", "is not a valid pattern"},
      {R"({"modules_to_save": [1]})", "must list strings"},
      {R"({"init_lora_weights": "pissa_niter_4"})", "mutates the base weight"},
      {R"({"layer_replication": [[0, 4]]})", "\"layer_replication\" is set"},
      {R"({"alora_invocation_tokens": [5]})", "cannot be merged"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    auto r = LoadAdapter(Peft(absl::StrCat("c", i), cases[i].config, pair), AdapterFormat::kAuto);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << cases[i].config;
    EXPECT_TRUE(Contains(r.status().message(), cases[i].want)) << cases[i].config;
    EXPECT_TRUE(Contains(r.status().message(), "adapter_config.json")) << cases[i].config;
  }
  // Accepted: true / "gaussian" inits, explicit nulls.
  auto ok = LoadAdapter(Peft("ok", R"({"r": 2, "lora_alpha": 2, "init_lora_weights": "gaussian",
      "layer_replication": null, "alpha_pattern": {}, "modules_to_save": null})",
                             pair),
                        AdapterFormat::kAuto);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(AdapterTest, PeftTensorErrorsNameFileAndKey) {
  const std::string cfg = R"({"r": 2, "lora_alpha": 2})";
  auto err = [&](const std::string& name, std::vector<TestTensor> t, const std::string& want) {
    auto r = LoadAdapter(Peft(name, cfg, t), AdapterFormat::kAuto);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_TRUE(Contains(r.status().message(), want)) << name;
    EXPECT_TRUE(Contains(r.status().message(), "adapter_model.safetensors")) << name;
  };
  const std::string a = absl::StrCat("base_model.model.", kQ, ".lora_A.weight");
  const std::string b = absl::StrCat("base_model.model.", kQ, ".lora_B.weight");
  err("noB", {F32(a, {2, 4}, Random(8, 1))}, "lora_A without lora_B");
  err("noA", {F32(b, {4, 2}, Random(8, 1))}, "lora_B without lora_A");
  err("rank", {F32(a, {2, 4}, Random(8, 1)), F32(b, {4, 3}, Random(12, 1))}, "rank mismatch");
  err("conv", {F32(a, {2, 4, 3, 3}, Random(72, 1)), F32(b, {4, 2, 1, 1}, Random(8, 1))},
      "conv LoRA is not supported");
  err("oned", {F32(a, {8}, Random(8, 1)), F32(b, {4, 2}, Random(8, 1))}, "must be 2-D");
  err("int", {I64(a, {2, 4}), F32(b, {4, 2}, Random(8, 1))}, "I64 is not a floating type");
  err("dup",
      {F32(a, {2, 4}, Random(8, 1)), F32(b, {4, 2}, Random(8, 1)),
       F32(absl::StrCat(kQ, ".lora_A.default.weight"), {2, 4}, Random(8, 1))},
      "are the same LoRA factor");
  err("none", {F32("base_model.model.x.weight", {2}, {1, 2})}, "no peft adapter tensors");
  // Broken safetensors.
  std::string d = MakeDir("broken");
  WriteFile(d + "/adapter_config.json", cfg);
  WriteFile(d + "/adapter_model.safetensors", std::string("\x10\0\0\0\0\0\0\0{\"a\":", 13));
  auto r = LoadAdapter(d, AdapterFormat::kAuto);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "adapter_model.safetensors"));
}

TEST_F(AdapterTest, MissingFilesAreNotFound) {
  auto r = LoadAdapter(Path("nope"), AdapterFormat::kAuto);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  std::string d = MakeDir("noconfig");
  WriteSafetensors(d + "/adapter_model.safetensors", PeftPair(kQ, 2, 4, 4, 1));
  r = LoadAdapter(d, AdapterFormat::kAuto);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(r.status().message(), "adapter_config.json"));
  std::string e = MakeDir("binonly");
  WriteFile(e + "/adapter_config.json", "{}");
  WriteFile(e + "/adapter_model.bin", "pickle");
  r = LoadAdapter(e, AdapterFormat::kPeft);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(r.status().message(), "adapter_model.bin"));
  // A directory is only a PEFT adapter.
  r = LoadAdapter(d, AdapterFormat::kKohya);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------ kohya

TEST_F(AdapterTest, KohyaWithAlphaInBf16) {
  std::string f = Path("k.safetensors");
  std::vector<float> down = Bf16Values(Random(4 * 6, 1)), up = Bf16Values(Random(5 * 4, 2));
  WriteSafetensors(
      f, {BF16("lora_unet_model_layers_0_self_attn_q_proj.lora_down.weight", {4, 6}, down),
          BF16("lora_unet_model_layers_0_self_attn_q_proj.lora_up.weight", {5, 4}, up),
          BF16("lora_unet_model_layers_0_self_attn_q_proj.alpha", {}, {2.0f}),
          F32("lora_unet_stray.alpha", {}, {1.0f}),
          F32("lora_unet_x.hada_w1_a", {2, 2}, {1, 2, 3, 4})});
  auto a = LoadAdapter(f, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->format, AdapterFormat::kKohya);
  ASSERT_EQ((*a)->entries.size(), 1u);
  const AdapterEntry& e = (*a)->entries[0];
  EXPECT_EQ(e.target, "lora_unet_model_layers_0_self_attn_q_proj");
  EXPECT_TRUE(e.needs_kohya_resolution);
  auto* p = As<LoraPatch>(&e);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->scale(), 0.5);
  EXPECT_EQ(p->factors().a, down);
  EXPECT_EQ(p->factors().b, up);
  EXPECT_EQ(Sorted((*a)->ignored_keys), Sorted({"lora_unet_stray.alpha", "lora_unet_x.hada_w1_a"}));
  std::vector<std::string> base = {"model.layers.0.self_attn.q_proj.weight",
                                   "model.layers.0.self_attn.q_proj.bias"};
  auto t = ResolveKohyaTarget(e.target, base);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, "model.layers.0.self_attn.q_proj.weight");
}

TEST_F(AdapterTest, KohyaMissingOrZeroAlphaMeansRank) {
  std::string f = Path("k0.safetensors");
  WriteSafetensors(
      f,
      {F32("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", {3, 4}, Random(12, 1)),
       F32("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", {2, 3}, Random(6, 2)),
       F32("lora_te_text_model_encoder_layers_0_mlp_fc2.lora_down.weight", {3, 4}, Random(12, 3)),
       F32("lora_te_text_model_encoder_layers_0_mlp_fc2.lora_up.weight", {2, 3}, Random(6, 4)),
       F32("lora_te_text_model_encoder_layers_0_mlp_fc2.alpha", {}, {0.0f}),
       // ComfyUI/Wan dotted module names: no resolution.
       F32("diffusion_model.blocks.0.ffn.0.lora_down.weight", {3, 4}, Random(12, 5)),
       F32("diffusion_model.blocks.0.ffn.0.lora_up.weight", {2, 3}, Random(6, 6)),
       F32("diffusion_model.blocks.0.ffn.0.alpha", {}, {6.0f})});
  auto a = LoadAdapter(f, AdapterFormat::kKohya);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ((*a)->entries.size(), 3u);
  EXPECT_EQ(As<LoraPatch>(Find(**a, "lora_te1_text_model_encoder_layers_0_mlp_fc1"))->scale(), 1.0);
  EXPECT_EQ(As<LoraPatch>(Find(**a, "lora_te_text_model_encoder_layers_0_mlp_fc2"))->scale(), 1.0);
  const AdapterEntry* dotted = Find(**a, "blocks.0.ffn.0.weight");
  ASSERT_NE(dotted, nullptr);
  EXPECT_FALSE(dotted->needs_kohya_resolution);
  EXPECT_EQ(As<LoraPatch>(dotted)->scale(), 2.0);
}

TEST_F(AdapterTest, KohyaErrorsAndDora) {
  auto err = [&](const std::string& name, std::vector<TestTensor> t, const std::string& want) {
    std::string f = Path(name + ".safetensors");
    WriteSafetensors(f, t);
    auto r = LoadAdapter(f, AdapterFormat::kAuto);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_TRUE(Contains(r.status().message(), want)) << name;
    EXPECT_TRUE(Contains(r.status().message(), f)) << name;
  };
  const std::string n = "lora_unet_blocks_0_attn_qkv";
  err("noup", {F32(n + ".lora_down.weight", {2, 4}, Random(8, 1))}, "lora_down without lora_up");
  err("alpha",
      {F32(n + ".lora_down.weight", {2, 4}, Random(8, 1)),
       F32(n + ".lora_up.weight", {3, 2}, Random(6, 1)), F32(n + ".alpha", {2}, {1, 1})},
      "alpha must be a scalar");
  err("rank",
      {F32(n + ".lora_down.weight", {2, 4}, Random(8, 1)),
       F32(n + ".lora_up.weight", {3, 3}, Random(9, 1))},
      "rank mismatch");
  err("doraaxis",
      {F32(n + ".lora_down.weight", {2, 4}, Random(8, 1)),
       F32(n + ".lora_up.weight", {3, 2}, Random(6, 1)),
       F32(n + ".dora_scale", {1, 4}, Random(4, 1))},
      "input-axis DoRA");
  std::string f = Path("dora.safetensors");
  WriteSafetensors(f, {F32(n + ".lora_down.weight", {2, 4}, Random(8, 1)),
                       F32(n + ".lora_up.weight", {3, 2}, Random(6, 1)),
                       F32(n + ".dora_scale", {3, 1}, {1, 2, 3})});
  auto a = LoadAdapter(f, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  auto* d = As<DoraPatch>(&(*a)->entries[0]);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->magnitude(), (std::vector<float>{1, 2, 3}));
}

TEST(KohyaResolveTest, ExactPrefixedBiasAmbiguousAndMissing) {
  std::vector<std::string> base = {"double_blocks.0.img_attn.qkv.weight",
                                   "double_blocks.0.img_attn.qkv.bias",
                                   "text_model.encoder.layers.0.mlp.fc1.weight",
                                   "a.b_c.weight",
                                   "a_b.c.weight",
                                   "model.diffusion_model.single_blocks.1.linear1.weight"};
  EXPECT_EQ(*ResolveKohyaTarget("lora_unet_double_blocks_0_img_attn_qkv", base),
            "double_blocks.0.img_attn.qkv.weight");
  EXPECT_EQ(*ResolveKohyaTarget("lora_transformer_double_blocks_0_img_attn_qkv", base),
            "double_blocks.0.img_attn.qkv.weight");
  EXPECT_EQ(*ResolveKohyaTarget("lora_unet_double_blocks_0_img_attn_qkv.bias", base),
            "double_blocks.0.img_attn.qkv.bias");
  EXPECT_EQ(*ResolveKohyaTarget("lora_te2_text_model_encoder_layers_0_mlp_fc1", base),
            "text_model.encoder.layers.0.mlp.fc1.weight");
  // A base with a prefix: matched on a dotted suffix.
  EXPECT_EQ(*ResolveKohyaTarget("lora_unet_single_blocks_1_linear1", base),
            "model.diffusion_model.single_blocks.1.linear1.weight");
  // "blocks_1_linear1" is not on a boundary of "single_blocks.1.linear1".
  EXPECT_EQ(ResolveKohyaTarget("lora_unet_gle_blocks_1_linear1", base).status().code(),
            absl::StatusCode::kNotFound);
  auto amb = ResolveKohyaTarget("lora_unet_a_b_c", base);
  EXPECT_EQ(amb.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(amb.status().message(), "ambiguous"));
  EXPECT_TRUE(Contains(amb.status().message(), "a.b_c.weight"));
  auto missing = ResolveKohyaTarget("lora_unet_nothing_here", base);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "lora_unet_nothing_here"));
}

// ------------------------------------------------------------ dense

TEST_F(AdapterTest, DensePayloads) {
  std::string f = Path("dense.safetensors");
  WriteSafetensors(
      f, {F32("blocks.0.norm.diff", {4}, {1, 2, 3, 4}), F32("blocks.0.proj.diff_b", {2}, {5, 6}),
          F32("scale_shift_table.diff_param", {1, 2}, {7, 8}),
          F32("diffusion_model.blocks.0.to_gate_compress.set_weight", {2, 2}, {1, 2, 3, 4}),
          BF16("blocks.0.proj_l.set_param", {2}, {0.5f, -2.0f}),
          F32("lora_unet_blocks_1_norm.diff", {2}, {1, 1}), F32("something.else", {1}, {0})});
  auto a = LoadAdapter(f, AdapterFormat::kAuto);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->format, AdapterFormat::kDense);
  EXPECT_EQ(Sorted((*a)->ignored_keys), Sorted({"something.else"}));
  ASSERT_EQ((*a)->entries.size(), 6u);
  auto kind = [&](const std::string& t) { return Find(**a, t)->patch->kind(); };
  EXPECT_EQ(kind("blocks.0.norm.weight"), TensorPatch::Kind::kAdd);
  EXPECT_EQ(kind("blocks.0.proj.bias"), TensorPatch::Kind::kAdd);
  EXPECT_EQ(kind("scale_shift_table"), TensorPatch::Kind::kAdd);
  EXPECT_EQ(kind("blocks.0.to_gate_compress.weight"), TensorPatch::Kind::kReplace);
  EXPECT_EQ(kind("blocks.0.proj_l"), TensorPatch::Kind::kReplace);
  EXPECT_TRUE(Find(**a, "lora_unet_blocks_1_norm")->needs_kohya_resolution);

  std::vector<float> acc = {10, 10, 10, 10};
  ASSERT_TRUE(Find(**a, "blocks.0.norm.weight")
                  ->patch->Apply({{1}, {2}}, {4}, 0.5f, nullptr, acc.data())
                  .ok());
  EXPECT_EQ(acc[0], 11.0f);  // 10 + 0.5·2
  EXPECT_EQ(acc[1], 11.5f);
  std::vector<float> w(4, 99.0f);
  const TensorPatch& set = *Find(**a, "blocks.0.to_gate_compress.weight")->patch;
  EXPECT_EQ(set.shape(), (std::vector<int64_t>{2, 2}));
  ASSERT_TRUE(set.Apply({{0, 0}, {2, 2}}, {2, 2}, 2.0f, nullptr, w.data()).ok());
  EXPECT_EQ(w, (std::vector<float>{2, 4, 6, 8}));  // strength · value
  std::vector<float> l(2);
  ASSERT_TRUE(
      Find(**a, "blocks.0.proj_l")->patch->Apply({{0}, {2}}, {2}, 1.0f, nullptr, l.data()).ok());
  EXPECT_EQ(l, (std::vector<float>{0.5f, -2.0f}));

  // Two payloads on one parameter are rejected.
  std::string g = Path("dup.safetensors");
  WriteSafetensors(g, {F32("m.diff", {2}, {1, 2}), F32("m.set_weight", {2}, {1, 2})});
  auto dup = LoadAdapter(g, AdapterFormat::kAuto);
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(dup.status().message(), "both patch \"m.weight\""));
}

// ------------------------------------------------------------ detection

TEST_F(AdapterTest, AutoDetectionAndExplicitFormats) {
  std::string mixed = Path("mixed.safetensors");
  WriteSafetensors(mixed, {F32("lora_unet_x.lora_down.weight", {2, 4}, Random(8, 1)),
                           F32("lora_unet_x.lora_up.weight", {3, 2}, Random(6, 2)),
                           F32("blocks.0.norm.diff", {2}, {1, 2})});
  auto k = LoadAdapter(mixed, AdapterFormat::kAuto);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ((*k)->format, AdapterFormat::kKohya);
  EXPECT_EQ((*k)->entries.size(), 2u);  // the low-rank term and the dense diff
  // Explicit dense: the LoRA keys are ignored.
  auto d = LoadAdapter(mixed, AdapterFormat::kDense);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->entries.size(), 1u);
  EXPECT_EQ((*d)->ignored_keys.size(), 2u);
  // Explicit PEFT on a kohya-only file: nothing it understands.
  std::string kohya = Path("kohya.safetensors");
  WriteSafetensors(kohya, {F32("lora_unet_x.lora_down.weight", {2, 4}, Random(8, 1)),
                           F32("lora_unet_x.lora_up.weight", {3, 2}, Random(6, 2))});
  auto p = LoadAdapter(kohya, AdapterFormat::kPeft);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(p.status().message(), "no peft adapter tensors"));

  std::string unknown = Path("unknown.safetensors");
  WriteSafetensors(unknown, {F32("model.layers.0.weight", {2}, {1, 2})});
  auto u = LoadAdapter(unknown, AdapterFormat::kAuto);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(u.status().message(), "cannot tell the adapter format"));
  EXPECT_TRUE(Contains(u.status().message(), "model.layers.0.weight"));

  std::string both = Path("both.safetensors");
  WriteSafetensors(both, Concat(PeftPair(kQ, 2, 4, 3, 1),
                                {F32("lora_unet_x.lora_down.weight", {2, 4}, Random(8, 1)),
                                 F32("lora_unet_x.lora_up.weight", {3, 2}, Random(6, 2))}));
  auto b = LoadAdapter(both, AdapterFormat::kAuto);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(b.status().message(), "mixes PEFT"));
  auto bk = LoadAdapter(both, AdapterFormat::kKohya);
  ASSERT_TRUE(bk.ok()) << bk.status();
  EXPECT_EQ((*bk)->ignored_keys.size(), 2u);
}

}  // namespace
}  // namespace weightd
