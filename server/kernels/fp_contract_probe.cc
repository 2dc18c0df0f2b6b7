// Built twice (common/CMakeLists.txt): WD_PROBE_PREFIX names the build.
#include "server/kernels/fp_contract_probe.h"

#include "server/kernels/cast_elements.h"
#include "server/kernels/merge_elements.h"

#define WD_PROBE_CAT2(a, b) a##b
#define WD_PROBE_CAT(a, b) WD_PROBE_CAT2(a, b)
#define WD_PROBE(name) WD_PROBE_CAT(WD_PROBE_PREFIX, name)

extern "C" __attribute__((visibility("default"))) void WD_PROBE(_merge)(
    const float* acc, const weightd::MergeTerm* terms, int n_terms, int64_t cols, size_t n,
    float* out) {
  for (size_t i = 0; i < n; ++i) {
    const int64_t e = static_cast<int64_t>(i);
    out[i] = weightd::MergeElement(acc[i], terms, n_terms, e / cols, e % cols, cols);
  }
}

extern "C" __attribute__((visibility("default"))) void WD_PROBE(_cast)(const float* in, size_t n,
                                                                       uint16_t* out) {
  namespace el = weightd::elements;
  for (size_t i = 0; i < n; ++i) {
    out[i] = el::FloatToHalf(in[i]);
    out[n + i] = el::FloatToBFloat16(in[i]);
    out[2 * n + i] = static_cast<uint16_t>(el::FloatToFp8E4M3(in[i]) |
                                           el::FloatToFp8E5M2(in[i]) << 8);
  }
}
