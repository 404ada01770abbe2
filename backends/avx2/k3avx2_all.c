/* k3avx2_all.c - the avx2 backend as one translation unit. backends/avx2_build.py puts the
 * generated contract constants (from k3core/api/contract.py) in front of this file. */
#include "k3avx2_runtime.c"
#include "k3avx2_pool.c"
#include "k3avx2_vexp512.c"
#include "k3avx2_vexp256.c"
#include "k3avx2_matmul512.c"
#include "k3avx2_span512.c"
#include "k3avx2_matmul.c"
#include "k3avx2_matmul256.c"
#include "k3avx2_experts.c"
#include "k3avx2_elementwise.c"
#include "k3avx2_attention.c"
#include "k3avx2_router.c"
