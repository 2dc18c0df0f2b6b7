/* XXH3-128 for CPUs with AVX512 (compiled with its flag; digest.cc calls it only where the CPU has it). */
#define WD_KERNEL avx512
#define WD_NAME "avx512"
#include "common/digest_kernel.inc"
