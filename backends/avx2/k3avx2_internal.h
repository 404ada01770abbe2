/* k3avx2_internal.h - shared helpers of the avx2 backend: the contract's scalar primitives
 * (transcendentals, lane fold, NaN-order helpers), the 32-lane SIMD accumulator and the
 * thread count. Every definition mirrors backends/exact_numpy.py operation for operation.
 *
 * The K3C_* constants are NOT written here: backends/avx2_build.py generates them from
 * k3core/api/contract.py (as C99 hex floats) and places them before this header.
 */
#ifndef K3AVX2_INTERNAL_H
#define K3AVX2_INTERNAL_H

#ifndef K3C_LANES
#error "k3 contract constants missing: build through backends/avx2_build.py (or write them with: python backends/avx2_build.py --header k3avx2_contract.h)"
#endif

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(K3C_LANES == 32, "the SIMD kernels are written for 32 float64 lanes (8 x 4)");
_Static_assert(K3C_MXFP4_GROUP == 32, "the MXFP4 kernel assumes one scale per 32 columns");

#define K3_ENOMEM (-1)
#define K3_EINVAL (-2)

/* ---- threads ------------------------------------------------------------------ */
int k3__threads(void);
/* 1 when the calling thread asked for every parallel path regardless of the thresholds
 * below (k3_set_force_parallel: the conformance tests use it so that the small test models
 * really run the multi-threaded code). */
int k3__forced(void);
/* Parallel loops run over independent outputs on the backend's pool (k3avx2_pool.c,
 * k3__pool_for); `work` says whether handing a loop to the pool pays off. Results never
 * depend on the thread count: each output is computed by one thread. */
/* Work (multiply-adds or elements times ~their cost) below which an op runs on the calling
 * thread: a hand-off costs microseconds on an idle machine, and more on a busy one, where
 * the helper must be scheduled before it takes a share. Every big op of the real model is
 * far above these; the tiny test models stay serial. */
#define K3_PAR_MATMUL (INT64_C(1) << 17)    /* rows * cols * tokens (on the pool: cheap) */
#define K3_PAR_ELEMENTS (INT64_C(1) << 15)  /* transcendental elements */
#define K3_PAR_ROWS (INT64_C(1) << 17)      /* norm elements */
#define K3_PAR_ATTENTION (INT64_C(1) << 20) /* lane-sum terms of an attention op */
/* Whether `work` reaches `threshold`, or the thresholds are switched off (k3__forced);
 * counts the regions that will run on more than one thread (k3_parallel_regions). */
int k3__par(int big);
#define K3_BIG(work, threshold) k3__par((work) >= (threshold) || k3__forced())

/* The storage kinds of a matrix product's weights. */
enum k3_wkind { K3_W_BF16, K3_W_F32, K3_W_MXFP4 };

void *k3__alloc(size_t bytes); /* 64-byte aligned, NULL on failure */
void k3__free(void *p);
/* `bytes` of the calling thread's own scratch (64-byte aligned, kept between calls and freed
 * when the thread exits; NULL on failure): a kernel's working copy, never a result. */
void *k3__scratch(size_t bytes);

/* ---- NaNs ------------------------------------------------------------------------------
 * All arithmetic is plain C on IEEE values. When exactly one operand is NaN the hardware
 * returns it quieted, as NumPy does. When two NaNs meet, NumPy's own choice of payload
 * depends on its SIMD path (the array length), so the contract does not fix it
 * (docs/kernel-contract.md §5). Never pass a NaN through without arithmetic: the compiler may
 * fold (float)(double)x to x and skip the quieting that NumPy's conversion performs. */
static inline double k3_nan_d(void) {
    union { uint64_t u; double d; } v = {UINT64_C(0x7FF8000000000000)};
    return v.d; /* NumPy's np.nan: positive quiet NaN, empty payload */
}

/* ---- transcendentals (exact_numpy.exp_d / expm1_d / tanh_d / sig_d) ------------------ */
static inline double k3_exp_d(double x) {
    if (isnan(x)) return k3_nan_d();
    if (x > K3C_EXP_HI) return HUGE_VAL;
    if (x < K3C_EXP_LO) return 0.0;
    double n = floor(x * K3C_LOG2E + 0.5);
    double r = (x - n * K3C_LN2_HI) - n * K3C_LN2_LO;
    double p = K3C_EXP_COEF[K3C_EXP_NCOEF - 1];
    for (int i = K3C_EXP_NCOEF - 2; i >= 0; --i) p = p * r + K3C_EXP_COEF[i];
    return ldexp(p, (int)n); /* n in [-1021, 1023] here: the result is normal and exact */
}

static inline double k3_expm1_d(double x) {
    if (fabs(x) < K3C_EXPM1_SERIES_MAX) {
        double q = K3C_EXPM1_COEF[K3C_EXPM1_NCOEF - 1];
        for (int i = K3C_EXPM1_NCOEF - 2; i >= 0; --i) q = q * x + K3C_EXPM1_COEF[i];
        return q * x;
    }
    return k3_exp_d(x) - 1.0;
}

static inline double k3_tanh_d(double x) {
    double a = fabs(x);
    int sat = a > K3C_TANH_SAT;
    double e = k3_expm1_d((sat ? 0.0 : a) * 2.0);
    double t = e / (e + 2.0);
    if (sat) t = 1.0;
    return copysign(t, x);
}

static inline double k3_sig_d(double x) { return 1.0 / (1.0 + k3_exp_d(-x)); }

static inline float k3_silu_f(float x) {
    double xd = (double)x;
    return (float)(xd * k3_sig_d(xd));
}

/* f32((b1 * tanh_d(g / b1) * sig_d(g)) * (b2 * tanh_d(u / b2))), float64 left to right. */
static inline float k3_situ_f(float g, float u, double b1, double b2) {
    double gd = (double)g, ud = (double)u;
    double a = b1 * k3_tanh_d(gd / b1) * k3_sig_d(gd);
    double c = b2 * k3_tanh_d(ud / b2);
    return (float)(a * c);
}

/* ---- the lane sum ------------------------------------------------------------------- */
/* Fold 32 float64 lanes in halves (lane j += lane j+h for h = 16..1); returns lane 0. */
static inline double k3_fold32(double *acc) {
    for (int h = K3C_LANES / 2; h >= 1; h /= 2)
        for (int j = 0; j < h; ++j) acc[j] = acc[j] + acc[j + h];
    return acc[0];
}

/* 32 lanes in 8 ymm registers: register k holds lanes 4k..4k+3 in order. */
typedef struct { __m256d a[8]; } k3_lanes;

static inline void k3_lanes_zero(k3_lanes *L) {
    for (int k = 0; k < 8; ++k) L->a[k] = _mm256_setzero_pd();
}

/* The register-level steps of k3_fold32 (h = 16, 8, 4): register j += register j + h / 4,
 * into t[0..3], the four slots of register 0. */
static inline void k3_lanes_fold_regs(const k3_lanes *L, double t[4]) {
    __m256d a0 = _mm256_add_pd(L->a[0], L->a[4]), a1 = _mm256_add_pd(L->a[1], L->a[5]);
    __m256d a2 = _mm256_add_pd(L->a[2], L->a[6]), a3 = _mm256_add_pd(L->a[3], L->a[7]);
    a0 = _mm256_add_pd(a0, a2);
    a1 = _mm256_add_pd(a1, a3);
    a0 = _mm256_add_pd(a0, a1);
    _mm256_storeu_pd(t, a0);
}

/* Fold the 8 registers exactly as k3_fold32 does. */
static inline double k3_lanes_fold(const k3_lanes *L) {
    double t[4];
    k3_lanes_fold_regs(L, t);
    double s0 = t[0] + t[2], s1 = t[1] + t[3];
    return s0 + s1;
}

/* Add d(a[i]) * d(b[i]) for i in [0, 32) to the lanes (a full chunk). */
static inline void k3_lanes_dot32(k3_lanes *L, const float *a, const float *b) {
    for (int k = 0; k < 8; ++k) {
        __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(a + 4 * k));
        __m256d y = _mm256_cvtps_pd(_mm_loadu_ps(b + 4 * k));
        L->a[k] = _mm256_add_pd(L->a[k], _mm256_mul_pd(x, y));
    }
}

/* lsum_i d(a[i]) * d(b[i]) over n terms (tail padded with +0.0 terms, as the reference). */
static inline double k3_dot_f32(const float *a, const float *b, int64_t n) {
    k3_lanes L;
    k3_lanes_zero(&L);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) k3_lanes_dot32(&L, a + i, b + i);
    if (i < n) {
        float ta[32] = {0}, tb[32] = {0};
        memcpy(ta, a + i, (size_t)(n - i) * sizeof(float));
        memcpy(tb, b + i, (size_t)(n - i) * sizeof(float));
        k3_lanes_dot32(&L, ta, tb);
    }
    return k3_lanes_fold(&L);
}

/* lsum_i d(a[i])^2 over n terms. */
static inline double k3_sumsq_f32(const float *a, int64_t n) { return k3_dot_f32(a, a, n); }

/* Scalar lane sum of n float64 terms (for short sums such as router renormalisation). */
static inline double k3_lsum_d(const double *t, int64_t n) {
    double acc[32] = {0};
    for (int64_t i = 0; i < n; ++i) acc[i % 32] = acc[i % 32] + t[i];
    return k3_fold32(acc);
}

#endif /* K3AVX2_INTERNAL_H */
