/* XXH3-128 for the build's baseline target (SSE2 on x86-64, NEON on arm64). */
#define WD_KERNEL baseline
#define WD_NAME "baseline"
#include "common/digest_kernel.inc"
