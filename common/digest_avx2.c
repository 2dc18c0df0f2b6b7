/* XXH3-128 for CPUs with AVX2 (compiled with its flag; digest.cc calls it only where the CPU has it). */
#define WD_KERNEL avx2
#define WD_NAME "avx2"
#include "common/digest_kernel.inc"
