/* k3avx2_elementwise.c - rmsnorm, l2norm, sigmoid, silu, exp and situ_glu
 * (k3core/api/kernels.py "normalisation and activations"). Scalar float64 code in the
 * reference's operation order; rows / elements are split across threads. */
#include "k3avx2_internal.h"

/* inv = f32(1 / sqrt(lsum(d(x)^2) / m + eps)); y = x * inv (float32), then * w. */
void k3_rmsnorm(const float *x, int64_t rows, int64_t m, const float *w, double eps, float *y) {
    K3_PARALLEL_FOR(K3_BIG(rows * m, K3_PAR_ROWS))
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * m;
        float *yr = y + r * m;
        float inv = (float)(1.0 / sqrt(k3_sumsq_f32(xr, m) / (double)m + eps));
        for (int64_t i = 0; i < m; ++i) yr[i] = xr[i] * inv;
        if (w)
            for (int64_t i = 0; i < m; ++i) yr[i] = yr[i] * w[i];
    }
}

/* inv = f32(1 / sqrt(lsum(d(x)^2) + L2_EPS)); y = x * inv. */
void k3_l2norm(const float *x, int64_t rows, int64_t m, float *y) {
    K3_PARALLEL_FOR(K3_BIG(rows * m, K3_PAR_ROWS))
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * m;
        float *yr = y + r * m;
        float inv = (float)(1.0 / sqrt(k3_sumsq_f32(xr, m) + K3C_L2_EPS));
        for (int64_t i = 0; i < m; ++i) yr[i] = xr[i] * inv;
    }
}

/* y = op(x) elementwise: blocks of 256 on the threads, eight lanes at a time on AVX-512
 * (k3avx2_vexp512.c), else four (k3avx2_vexp256.c): the scalar expressions operation for
 * operation. */
static void unary(int op, const float *x, int64_t n, float *y) {
    const int64_t blocks = (n + 255) / 256;
    K3_PARALLEL_FOR(K3_BIG(n, K3_PAR_ELEMENTS))
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = 256 * b, len = n - i < 256 ? n - i : 256;
        if (g_avx512)
            k3__unary512(op, x + i, len, y + i);
        else
            k3__unary256(op, x + i, len, y + i);
    }
}

void k3_sigmoid(const float *x, int64_t n, float *y) { unary(K3_U_SIG, x, n, y); }

void k3_silu(const float *x, int64_t n, float *y) { unary(K3_U_SILU, x, n, y); }

void k3_exp(const float *x, int64_t n, float *y) { unary(K3_U_EXP, x, n, y); }

/* f32((b1 * tanh_d(g / b1) * sig_d(g)) * (b2 * tanh_d(u / b2))), float64 left to right. */
void k3_situ_glu(const float *g, const float *u, int64_t n, double b1, double b2, float *y) {
    const int64_t blocks = (n + 255) / 256;
    K3_PARALLEL_FOR(K3_BIG(n, K3_PAR_ELEMENTS))
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = 256 * b, len = n - i < 256 ? n - i : 256;
        k3__situ(g + i, u + i, len, b1, b2, y + i);
    }
}
