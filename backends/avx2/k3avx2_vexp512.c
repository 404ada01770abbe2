/* k3avx2_vexp512.c - the contract's transcendentals eight float64 lanes at a time (AVX-512),
 * for SiTU, the per-token elementwise op with the most calls. Operation for operation the
 * scalar k3_exp_d / k3_expm1_d / k3_tanh_d / k3_sig_d of k3avx2_internal.h: every multiply
 * and add is its own instruction (no FMA), branches become blends of both sides.
 *
 * ldexp(p, n) is p * 2**n with 2**n built from its bits: for x in [EXP_LO, EXP_HI] the
 * reduction gives n in [-1021, 1023], so 2**n is a normal double and p (in [0.7, 1.42]) times
 * it is exact and normal, which is what ldexp returns. Lanes outside that range are replaced
 * by +inf, +0.0 or NaN afterwards, exactly as the scalar code branches.
 */
#include "k3avx2_internal.h"

#define K3_V512 __attribute__((target("avx512f,avx512dq,avx512vl"))) static inline \
    __attribute__((always_inline))

K3_V512 __m512d v_exp_d(__m512d x) {
    const __m512d nn = _mm512_roundscale_pd(
        _mm512_add_pd(_mm512_mul_pd(x, _mm512_set1_pd(K3C_LOG2E)), _mm512_set1_pd(0.5)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __mmask8 nan = _mm512_cmp_pd_mask(x, x, _CMP_UNORD_Q);
    const __mmask8 hi = _mm512_cmp_pd_mask(x, _mm512_set1_pd(K3C_EXP_HI), _CMP_GT_OQ);
    const __mmask8 lo = _mm512_cmp_pd_mask(x, _mm512_set1_pd(K3C_EXP_LO), _CMP_LT_OQ);
    const __mmask8 bad = nan | hi | lo;
    const __m512d n = _mm512_mask_blend_pd(bad, nn, _mm512_setzero_pd()); /* keep ints sane */
    __m512d r = _mm512_sub_pd(_mm512_sub_pd(x, _mm512_mul_pd(n, _mm512_set1_pd(K3C_LN2_HI))),
                              _mm512_mul_pd(n, _mm512_set1_pd(K3C_LN2_LO)));
    __m512d p = _mm512_set1_pd(K3C_EXP_COEF[K3C_EXP_NCOEF - 1]);
    for (int i = K3C_EXP_NCOEF - 2; i >= 0; --i)
        p = _mm512_add_pd(_mm512_mul_pd(p, r), _mm512_set1_pd(K3C_EXP_COEF[i]));
    const __m512i e = _mm512_slli_epi64(
        _mm512_add_epi64(_mm512_cvttpd_epi64(n), _mm512_set1_epi64(1023)), 52);
    __m512d y = _mm512_mul_pd(p, _mm512_castsi512_pd(e));
    y = _mm512_mask_blend_pd(hi, y, _mm512_set1_pd(HUGE_VAL));
    y = _mm512_mask_blend_pd(lo, y, _mm512_setzero_pd());
    return _mm512_mask_blend_pd(nan, y, _mm512_set1_pd(k3_nan_d()));
}

K3_V512 __m512d v_abs(__m512d x) {
    return _mm512_castsi512_pd(
        _mm512_and_si512(_mm512_castpd_si512(x), _mm512_set1_epi64(INT64_C(0x7FFFFFFFFFFFFFFF))));
}

K3_V512 __m512d v_expm1_d(__m512d x) {
    const __mmask8 small = _mm512_cmp_pd_mask(v_abs(x), _mm512_set1_pd(K3C_EXPM1_SERIES_MAX),
                                              _CMP_LT_OQ);
    __m512d q = _mm512_set1_pd(K3C_EXPM1_COEF[K3C_EXPM1_NCOEF - 1]);
    for (int i = K3C_EXPM1_NCOEF - 2; i >= 0; --i)
        q = _mm512_add_pd(_mm512_mul_pd(q, x), _mm512_set1_pd(K3C_EXPM1_COEF[i]));
    const __m512d series = _mm512_mul_pd(q, x);
    if (small == 0xFF) return series;
    const __m512d big = _mm512_sub_pd(v_exp_d(x), _mm512_set1_pd(1.0));
    return _mm512_mask_blend_pd(small, big, series);
}

K3_V512 __m512d v_tanh_d(__m512d x) {
    const __m512d a = v_abs(x);
    const __mmask8 sat = _mm512_cmp_pd_mask(a, _mm512_set1_pd(K3C_TANH_SAT), _CMP_GT_OQ);
    const __m512d e = v_expm1_d(
        _mm512_mul_pd(_mm512_mask_blend_pd(sat, a, _mm512_setzero_pd()), _mm512_set1_pd(2.0)));
    __m512d t = _mm512_div_pd(e, _mm512_add_pd(e, _mm512_set1_pd(2.0)));
    t = _mm512_mask_blend_pd(sat, t, _mm512_set1_pd(1.0));
    const __m512i sign = _mm512_set1_epi64(INT64_MIN);
    return _mm512_castsi512_pd(_mm512_or_si512(  /* copysign(t, x) */
        _mm512_andnot_si512(sign, _mm512_castpd_si512(t)),
        _mm512_and_si512(sign, _mm512_castpd_si512(x))));
}

K3_V512 __m512d v_sig_d(__m512d x) {
    const __m512d one = _mm512_set1_pd(1.0);
    const __m512d negx = _mm512_castsi512_pd(
        _mm512_xor_si512(_mm512_castpd_si512(x), _mm512_set1_epi64(INT64_MIN)));
    return _mm512_div_pd(one, _mm512_add_pd(one, v_exp_d(negx)));
}

/* y[i] = k3_situ_f(g[i], u[i], b1, b2) for i < n (a tail of n % 8 goes through the scalar). */
__attribute__((target("avx512f,avx512dq,avx512vl"))) static void
k3__situ512(const float *g, const float *u, int64_t n, double b1, double b2, float *y) {
    const __m512d vb1 = _mm512_set1_pd(b1), vb2 = _mm512_set1_pd(b2);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m512d gd = _mm512_cvtps_pd(_mm256_loadu_ps(g + i));
        const __m512d ud = _mm512_cvtps_pd(_mm256_loadu_ps(u + i));
        const __m512d a = _mm512_mul_pd(
            _mm512_mul_pd(vb1, v_tanh_d(_mm512_div_pd(gd, vb1))), v_sig_d(gd));
        const __m512d c = _mm512_mul_pd(vb2, v_tanh_d(_mm512_div_pd(ud, vb2)));
        _mm256_storeu_ps(y + i, _mm512_cvtpd_ps(_mm512_mul_pd(a, c)));
    }
    for (; i < n; ++i) y[i] = k3_situ_f(g[i], u[i], b1, b2);
}

/* ---- the other elementwise transcendentals, eight lanes at a time ---------------------
 * Each is the scalar expression of k3avx2_internal.h with its operands in the same order:
 * sigmoid f32(sig_d(d(x))), silu f32(d(x) * sig_d(d(x))), exp f32(exp_d(d(x))). */
enum { K3_U_SIG = 0, K3_U_SILU = 1, K3_U_EXP = 2 };

K3_V512 __m512d v_unary(int op, __m512d xd) {
    if (op == K3_U_SIG) return v_sig_d(xd);
    if (op == K3_U_SILU) return _mm512_mul_pd(xd, v_sig_d(xd));
    return v_exp_d(xd);
}

static inline float k3__unary_f(int op, float x) {
    if (op == K3_U_SIG) return (float)k3_sig_d((double)x);
    if (op == K3_U_SILU) return k3_silu_f(x);
    return (float)k3_exp_d((double)x);
}

/* y[i] = op(x[i]) for i < n (a tail of n % 8 through the scalar code). */
__attribute__((target("avx512f,avx512dq,avx512vl"))) static void
k3__unary512(int op, const float *x, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm512_cvtpd_ps(v_unary(op, _mm512_cvtps_pd(_mm256_loadu_ps(x + i)))));
    for (; i < n; ++i) y[i] = k3__unary_f(op, x[i]);
}

/* kda_gate over D elements of one (token, head): y = f32(exp_d(lb * sig_d(a * (d(z) + d(dt))))). */
__attribute__((target("avx512f,avx512dq,avx512vl"))) static void
k3__kda_gate512(const float *z, const float *dt, double a, double lb, int64_t D, float *y) {
    const __m512d va = _mm512_set1_pd(a), vlb = _mm512_set1_pd(lb);
    int64_t j = 0;
    for (; j + 8 <= D; j += 8) {
        const __m512d u = _mm512_mul_pd(
            va, _mm512_add_pd(_mm512_cvtps_pd(_mm256_loadu_ps(z + j)), _mm512_cvtps_pd(_mm256_loadu_ps(dt + j))));
        _mm256_storeu_ps(y + j, _mm512_cvtpd_ps(v_exp_d(_mm512_mul_pd(vlb, v_sig_d(u)))));
    }
    for (; j < D; ++j) {
        double u = a * ((double)z[j] + (double)dt[j]);
        y[j] = (float)k3_exp_d(lb * k3_sig_d(u));
    }
}

