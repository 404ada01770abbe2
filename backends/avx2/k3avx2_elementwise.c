/* k3avx2_elementwise.c - rmsnorm, l2norm, sigmoid, silu, exp and situ_glu
 * (k3core/api/kernels.py "normalisation and activations"). Scalar float64 code in the
 * reference's operation order; rows / elements are split across threads. */
#include "k3avx2_internal.h"

typedef struct {
    const float *x, *w;
    int64_t m;
    double eps;
    float *y;
} norm_job;

/* inv = f32(1 / sqrt(lsum(d(x)^2) / m + eps)); y = x * inv (float32), then * w. */
static void rmsnorm_fn(void *ctx, int64_t r0, int64_t r1) {
    const norm_job *j = (const norm_job *)ctx;
    const int64_t m = j->m;
    for (int64_t r = r0; r < r1; ++r) {
        const float *xr = j->x + r * m;
        float *yr = j->y + r * m;
        float inv = (float)(1.0 / sqrt(k3_sumsq_f32(xr, m) / (double)m + j->eps));
        for (int64_t i = 0; i < m; ++i) yr[i] = xr[i] * inv;
        if (j->w)
            for (int64_t i = 0; i < m; ++i) yr[i] = yr[i] * j->w[i];
    }
}

void k3_rmsnorm(const float *x, int64_t rows, int64_t m, const float *w, double eps, float *y) {
    norm_job j = {x, w, m, eps, y};
    k3__pool_for(K3_BIG(rows * m, K3_PAR_ROWS), rmsnorm_fn, &j, rows, k3__even_chunk(rows));
}

/* inv = f32(1 / sqrt(lsum(d(x)^2) + L2_EPS)); y = x * inv. */
static void l2norm_fn(void *ctx, int64_t r0, int64_t r1) {
    const norm_job *j = (const norm_job *)ctx;
    const int64_t m = j->m;
    for (int64_t r = r0; r < r1; ++r) {
        const float *xr = j->x + r * m;
        float *yr = j->y + r * m;
        float inv = (float)(1.0 / sqrt(k3_sumsq_f32(xr, m) + K3C_L2_EPS));
        for (int64_t i = 0; i < m; ++i) yr[i] = xr[i] * inv;
    }
}

void k3_l2norm(const float *x, int64_t rows, int64_t m, float *y) {
    norm_job j = {x, NULL, m, 0.0, y};
    k3__pool_for(K3_BIG(rows * m, K3_PAR_ROWS), l2norm_fn, &j, rows, k3__even_chunk(rows));
}

/* Elementwise ops go in blocks of 256 elements (the items of their pool loops). */
#define EW_BLOCK 256

typedef struct {
    int op;
    const float *x, *u;
    int64_t n;
    double b1, b2;
    float *y;
} ew_job;

static void unary_fn(void *ctx, int64_t b0, int64_t b1) {
    const ew_job *j = (const ew_job *)ctx;
    for (int64_t b = b0; b < b1; ++b) {
        const int64_t i = EW_BLOCK * b, len = j->n - i < EW_BLOCK ? j->n - i : EW_BLOCK;
        if (g_avx512)
            k3__unary512(j->op, j->x + i, len, j->y + i);
        else
            k3__unary256(j->op, j->x + i, len, j->y + i);
    }
}

/* y = op(x) elementwise: blocks of 256 on the threads, eight lanes at a time on AVX-512
 * (k3avx2_vexp512.c), else four (k3avx2_vexp256.c): the scalar expressions operation for
 * operation. */
static void unary(int op, const float *x, int64_t n, float *y) {
    const int64_t blocks = (n + EW_BLOCK - 1) / EW_BLOCK;
    ew_job j = {op, x, NULL, n, 0.0, 0.0, y};
    k3__pool_for(K3_BIG(n, K3_PAR_ELEMENTS), unary_fn, &j, blocks, k3__even_chunk(blocks));
}

void k3_sigmoid(const float *x, int64_t n, float *y) { unary(K3_U_SIG, x, n, y); }

void k3_silu(const float *x, int64_t n, float *y) { unary(K3_U_SILU, x, n, y); }

void k3_exp(const float *x, int64_t n, float *y) { unary(K3_U_EXP, x, n, y); }

static void situ_glu_fn(void *ctx, int64_t b0, int64_t b1) {
    const ew_job *j = (const ew_job *)ctx;
    for (int64_t b = b0; b < b1; ++b) {
        const int64_t i = EW_BLOCK * b, len = j->n - i < EW_BLOCK ? j->n - i : EW_BLOCK;
        k3__situ(j->x + i, j->u + i, len, j->b1, j->b2, j->y + i);
    }
}

/* f32((b1 * tanh_d(g / b1) * sig_d(g)) * (b2 * tanh_d(u / b2))), float64 left to right. */
void k3_situ_glu(const float *g, const float *u, int64_t n, double b1, double b2, float *y) {
    const int64_t blocks = (n + EW_BLOCK - 1) / EW_BLOCK;
    ew_job j = {0, g, u, n, b1, b2, y};
    k3__pool_for(K3_BIG(n, K3_PAR_ELEMENTS), situ_glu_fn, &j, blocks, k3__even_chunk(blocks));
}
