/* k3avx2_vexp256.c - the contract's transcendentals four float64 lanes at a time (AVX2), for
 * the CPUs without AVX-512 (k3avx2_vexp512.c has the eight-lane ones): SiTU, sigmoid, silu,
 * exp, kda_gate and shortconv's silu. Operation for operation the scalar k3_exp_d /
 * k3_expm1_d / k3_tanh_d / k3_sig_d of k3avx2_internal.h: every multiply and add is its own
 * instruction (no FMA; the build's -ffp-contract=off keeps it so), branches become blends of
 * both sides, so every lane is the scalar code's value.
 *
 * ldexp(p, n) is p * 2**n with 2**n built from its bits, as in k3avx2_vexp512.c (n in
 * [-1021, 1023] for x in [EXP_LO, EXP_HI]: 2**n is normal and the product exact). AVX2 has
 * no float64 -> int64 conversion; n is a whole number, so n + (1023 + 2**52) is exact and its
 * low bits are n + 1023.
 */
#include "k3avx2_internal.h"

#define K3_V256 static inline __attribute__((always_inline))

K3_V256 __m256d v4_sel(__m256d mask, __m256d if_set, __m256d otherwise) {
    return _mm256_blendv_pd(otherwise, if_set, mask);
}

/* Ties the n chains' values at one Horner step (an empty asm that "changes" them), so the
 * compiler keeps the steps of independent chains side by side: left alone, GCC emitted each
 * chain whole, one after another, and the core waited on one chain's latency at a time. */
K3_V256 void v4n_step(const int n, __m256d *v) {
    if (n == 2) __asm__("" : "+x"(v[0]), "+x"(v[1]));
    if (n == 4) __asm__("" : "+x"(v[0]), "+x"(v[1]), "+x"(v[2]), "+x"(v[3]));
}

/* exp_d of n vectors (n = 1, 2 or 4), each lane k3_exp_d's value: their Horner chains advance
 * together, so the latency of one step of one chain overlaps the others'. */
K3_V256 void v4n_exp_d(const int n, const __m256d *x, __m256d *y) {
    __m256d r[4], p[4], nv[4], hi[4], lo[4], nan[4];
    for (int j = 0; j < n; ++j) {
        const __m256d nn = _mm256_round_pd(
            _mm256_add_pd(_mm256_mul_pd(x[j], _mm256_set1_pd(K3C_LOG2E)), _mm256_set1_pd(0.5)),
            _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        nan[j] = _mm256_cmp_pd(x[j], x[j], _CMP_UNORD_Q);
        hi[j] = _mm256_cmp_pd(x[j], _mm256_set1_pd(K3C_EXP_HI), _CMP_GT_OQ);
        lo[j] = _mm256_cmp_pd(x[j], _mm256_set1_pd(K3C_EXP_LO), _CMP_LT_OQ);
        nv[j] = v4_sel(_mm256_or_pd(nan[j], _mm256_or_pd(hi[j], lo[j])), _mm256_setzero_pd(), nn);
        r[j] = _mm256_sub_pd(_mm256_sub_pd(x[j], _mm256_mul_pd(nv[j], _mm256_set1_pd(K3C_LN2_HI))),
                             _mm256_mul_pd(nv[j], _mm256_set1_pd(K3C_LN2_LO)));
        p[j] = _mm256_set1_pd(K3C_EXP_COEF[K3C_EXP_NCOEF - 1]);
    }
    for (int i = K3C_EXP_NCOEF - 2; i >= 0; --i) {
        for (int j = 0; j < n; ++j)
            p[j] = _mm256_add_pd(_mm256_mul_pd(p[j], r[j]), _mm256_set1_pd(K3C_EXP_COEF[i]));
        v4n_step(n, p);
    }
    const __m256i magic = _mm256_set1_epi64x(INT64_C(0x4330000000000000)); /* bits of 2**52 */
    for (int j = 0; j < n; ++j) {
        const __m256i biased = _mm256_sub_epi64(
            _mm256_castpd_si256(_mm256_add_pd(nv[j], _mm256_set1_pd(1023.0 + 4503599627370496.0))), magic);
        __m256d v = _mm256_mul_pd(p[j], _mm256_castsi256_pd(_mm256_slli_epi64(biased, 52)));
        v = v4_sel(hi[j], _mm256_set1_pd(HUGE_VAL), v);
        v = v4_sel(lo[j], _mm256_setzero_pd(), v);
        y[j] = v4_sel(nan[j], _mm256_set1_pd(k3_nan_d()), v);
    }
}

K3_V256 __m256d v4_exp_d(__m256d x) {
    __m256d y;
    v4n_exp_d(1, &x, &y);
    return y;
}

K3_V256 __m256d v4_abs(__m256d x) {
    return _mm256_and_pd(x, _mm256_castsi256_pd(_mm256_set1_epi64x(INT64_C(0x7FFFFFFFFFFFFFFF))));
}

K3_V256 __m256d v4_expm1_d(__m256d x) {
    const __m256d small = _mm256_cmp_pd(v4_abs(x), _mm256_set1_pd(K3C_EXPM1_SERIES_MAX), _CMP_LT_OQ);
    __m256d q = _mm256_set1_pd(K3C_EXPM1_COEF[K3C_EXPM1_NCOEF - 1]);
    for (int i = K3C_EXPM1_NCOEF - 2; i >= 0; --i)
        q = _mm256_add_pd(_mm256_mul_pd(q, x), _mm256_set1_pd(K3C_EXPM1_COEF[i]));
    const __m256d series = _mm256_mul_pd(q, x);
    if (_mm256_movemask_pd(small) == 0xF) return series;
    const __m256d big = _mm256_sub_pd(v4_exp_d(x), _mm256_set1_pd(1.0));
    return v4_sel(small, series, big);
}

K3_V256 __m256d v4_tanh_d(__m256d x) {
    const __m256d a = v4_abs(x);
    const __m256d sat = _mm256_cmp_pd(a, _mm256_set1_pd(K3C_TANH_SAT), _CMP_GT_OQ);
    const __m256d e = v4_expm1_d(_mm256_mul_pd(v4_sel(sat, _mm256_setzero_pd(), a), _mm256_set1_pd(2.0)));
    __m256d t = _mm256_div_pd(e, _mm256_add_pd(e, _mm256_set1_pd(2.0)));
    t = v4_sel(sat, _mm256_set1_pd(1.0), t);
    const __m256d sign = _mm256_castsi256_pd(_mm256_set1_epi64x(INT64_MIN));
    return _mm256_or_pd(_mm256_andnot_pd(sign, t), _mm256_and_pd(sign, x)); /* copysign(t, x) */
}

/* 1 / (1 + e) for e = exp_d(-x): the sigmoid's last step. */
K3_V256 __m256d v4_sig_from_exp(__m256d e) {
    const __m256d one = _mm256_set1_pd(1.0);
    return _mm256_div_pd(one, _mm256_add_pd(one, e));
}

/* sig_d of n vectors (n = 1, 2 or 4), their exp_d chains side by side. */
K3_V256 void v4n_sig_d(const int n, const __m256d *x, __m256d *y) {
    const __m256d sign = _mm256_castsi256_pd(_mm256_set1_epi64x(INT64_MIN));
    __m256d negx[4];
    for (int j = 0; j < n; ++j) negx[j] = _mm256_xor_pd(x[j], sign);
    v4n_exp_d(n, negx, y);
    for (int j = 0; j < n; ++j) y[j] = v4_sig_from_exp(y[j]);
}

K3_V256 __m256d v4_sig_d(__m256d x) {
    __m256d y;
    v4n_sig_d(1, &x, &y);
    return y;
}

/* Whether every lane of the n vectors is set in mask. */
K3_V256 int v4n_all(const int n, const __m256d *mask) {
    int all = 0xF;
    for (int j = 0; j < n; ++j) all &= _mm256_movemask_pd(mask[j]);
    return all == 0xF;
}

/* a * b with a as the instruction's first source: where both are NaN, x86 returns the
 * first source's, and the compiler may otherwise swap a product's operands. These are the
 * products where a NaN of g meets the sigmoid's or u's NaN; the contract leaves that NaN's
 * sign open (docs/avx2-backend.md, NaN), but the vector code answers as the scalar code
 * does: (b1 * tanh) first against the sigmoid, u's factor first against g's. */
K3_V256 __m256d v4_mul_first(__m256d a, __m256d b) {
    __m256d r;
    __asm__("vmulpd %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
    return r;
}

/* SiTU of eight elements (two vectors of g and u) with their chains in flight together: the
 * expm1 series of both tanh arguments side by side, then exp_d of -g (the sigmoid) beside
 * exp_d of the g tanh's argument (its expm1 away from zero), and the u tanh's exp_d only
 * when a lane of it needs one. Each lane gets v4_tanh_d / v4_sig_d's operations in their
 * order, so the bits are k3_situ_f's. */
K3_V256 __m128 v4_situ_pair(__m256d vb1, __m256d vb2, __m256d g0, __m256d g1, __m256d u0,
                            __m256d u1, __m128 *second) {
    const __m256d one = _mm256_set1_pd(1.0), two = _mm256_set1_pd(2.0);
    const __m256d sign = _mm256_castsi256_pd(_mm256_set1_epi64x(INT64_MIN));
    __m256d in[4], sat[4], arg[4], small[4], q[4], e[4], ex[4];
    in[0] = _mm256_div_pd(g0, vb1);
    in[1] = _mm256_div_pd(g1, vb1);
    in[2] = _mm256_div_pd(u0, vb2);
    in[3] = _mm256_div_pd(u1, vb2);
    for (int j = 0; j < 4; ++j) {
        const __m256d a = v4_abs(in[j]);
        sat[j] = _mm256_cmp_pd(a, _mm256_set1_pd(K3C_TANH_SAT), _CMP_GT_OQ);
        arg[j] = _mm256_mul_pd(v4_sel(sat[j], _mm256_setzero_pd(), a), two);
        small[j] = _mm256_cmp_pd(v4_abs(arg[j]), _mm256_set1_pd(K3C_EXPM1_SERIES_MAX), _CMP_LT_OQ);
        q[j] = _mm256_set1_pd(K3C_EXPM1_COEF[K3C_EXPM1_NCOEF - 1]);
    }
    for (int i = K3C_EXPM1_NCOEF - 2; i >= 0; --i) {
        for (int j = 0; j < 4; ++j)
            q[j] = _mm256_add_pd(_mm256_mul_pd(q[j], arg[j]), _mm256_set1_pd(K3C_EXPM1_COEF[i]));
        v4n_step(4, q);
    }
    for (int j = 0; j < 4; ++j) e[j] = _mm256_mul_pd(q[j], arg[j]);
    __m256d xin[4] = {_mm256_xor_pd(g0, sign), _mm256_xor_pd(g1, sign), arg[0], arg[1]};
    if (!v4n_all(2, small)) {
        v4n_exp_d(4, xin, ex);
        for (int j = 0; j < 2; ++j) e[j] = v4_sel(small[j], e[j], _mm256_sub_pd(ex[2 + j], one));
    } else {
        v4n_exp_d(2, xin, ex);
    }
    if (!v4n_all(2, small + 2)) {
        __m256d eu[2];
        v4n_exp_d(2, arg + 2, eu);
        for (int j = 0; j < 2; ++j) e[2 + j] = v4_sel(small[2 + j], e[2 + j], _mm256_sub_pd(eu[j], one));
    }
    __m256d t[4];
    for (int j = 0; j < 4; ++j) {
        __m256d v = _mm256_div_pd(e[j], _mm256_add_pd(e[j], two));
        v = v4_sel(sat[j], one, v);
        t[j] = _mm256_or_pd(_mm256_andnot_pd(sign, v), _mm256_and_pd(sign, in[j])); /* copysign */
    }
    __m256d y[2];
    for (int j = 0; j < 2; ++j) {
        const __m256d a = v4_mul_first(_mm256_mul_pd(vb1, t[j]), v4_sig_from_exp(ex[j]));
        const __m256d c = _mm256_mul_pd(vb2, t[2 + j]);
        y[j] = v4_mul_first(c, a);
    }
    *second = _mm256_cvtpd_ps(y[1]);
    return _mm256_cvtpd_ps(y[0]);
}

/* y[i] = k3_situ_f(g[i], u[i], b1, b2) for i < n, eight at a time (v4_situ_pair), then four,
 * then a tail of n % 4 through the scalar code. */
static void k3__situ256(const float *g, const float *u, int64_t n, double b1, double b2, float *y) {
    const __m256d vb1 = _mm256_set1_pd(b1), vb2 = _mm256_set1_pd(b2);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128 hi;
        const __m128 lo = v4_situ_pair(
            vb1, vb2, _mm256_cvtps_pd(_mm_loadu_ps(g + i)), _mm256_cvtps_pd(_mm_loadu_ps(g + i + 4)),
            _mm256_cvtps_pd(_mm_loadu_ps(u + i)), _mm256_cvtps_pd(_mm_loadu_ps(u + i + 4)), &hi);
        _mm_storeu_ps(y + i, lo);
        _mm_storeu_ps(y + i + 4, hi);
    }
    for (; i + 4 <= n; i += 4) {
        const __m256d gd = _mm256_cvtps_pd(_mm_loadu_ps(g + i));
        const __m256d ud = _mm256_cvtps_pd(_mm_loadu_ps(u + i));
        const __m256d a = _mm256_mul_pd(_mm256_mul_pd(vb1, v4_tanh_d(_mm256_div_pd(gd, vb1))), v4_sig_d(gd));
        const __m256d c = _mm256_mul_pd(vb2, v4_tanh_d(_mm256_div_pd(ud, vb2)));
        _mm_storeu_ps(y + i, _mm256_cvtpd_ps(_mm256_mul_pd(a, c)));
    }
    for (; i < n; ++i) y[i] = k3_situ_f(g[i], u[i], b1, b2);
}

/* sigmoid f32(sig_d(d(x))), silu f32(d(x) * sig_d(d(x))), exp f32(exp_d(d(x))) (the op codes
 * of k3avx2_vexp512.c). */
K3_V256 __m256d v4_unary(int op, __m256d xd) {
    if (op == K3_U_SIG) return v4_sig_d(xd);
    if (op == K3_U_SILU) return _mm256_mul_pd(xd, v4_sig_d(xd));
    return v4_exp_d(xd);
}

/* y[i] = op(x[i]) for i < n (a tail of n % 4 through the scalar code). */
static void k3__unary256(int op, const float *x, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) { /* four vectors' exp_d chains side by side */
        __m256d xd[4], v[4];
        for (int j = 0; j < 4; ++j) xd[j] = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * j));
        if (op == K3_U_EXP)
            v4n_exp_d(4, xd, v);
        else
            v4n_sig_d(4, xd, v);
        for (int j = 0; j < 4; ++j) {
            if (op == K3_U_SILU) v[j] = _mm256_mul_pd(xd[j], v[j]);
            _mm_storeu_ps(y + i + 4 * j, _mm256_cvtpd_ps(v[j]));
        }
    }
    for (; i + 4 <= n; i += 4)
        _mm_storeu_ps(y + i, _mm256_cvtpd_ps(v4_unary(op, _mm256_cvtps_pd(_mm_loadu_ps(x + i)))));
    for (; i < n; ++i) y[i] = k3__unary_f(op, x[i]);
}

/* kda_gate over D elements of one (token, head): y = f32(exp_d(lb * sig_d(a * (d(z) + d(dt))))). */
static void k3__kda_gate256(const float *z, const float *dt, double a, double lb, int64_t D, float *y) {
    const __m256d va = _mm256_set1_pd(a), vlb = _mm256_set1_pd(lb);
    int64_t j = 0;
    for (; j + 16 <= D; j += 16) { /* four vectors' exp_d chains side by side */
        __m256d u[4], v[4];
        for (int q = 0; q < 4; ++q)
            u[q] = _mm256_mul_pd(va, _mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(z + j + 4 * q)),
                                                   _mm256_cvtps_pd(_mm_loadu_ps(dt + j + 4 * q))));
        v4n_sig_d(4, u, v);
        for (int q = 0; q < 4; ++q) u[q] = _mm256_mul_pd(vlb, v[q]);
        v4n_exp_d(4, u, v);
        for (int q = 0; q < 4; ++q) _mm_storeu_ps(y + j + 4 * q, _mm256_cvtpd_ps(v[q]));
    }
    for (; j + 4 <= D; j += 4) {
        const __m256d u = _mm256_mul_pd(
            va, _mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(z + j)), _mm256_cvtps_pd(_mm_loadu_ps(dt + j))));
        _mm_storeu_ps(y + j, _mm256_cvtpd_ps(v4_exp_d(_mm256_mul_pd(vlb, v4_sig_d(u)))));
    }
    for (; j < D; ++j) {
        double u = a * ((double)z[j] + (double)dt[j]);
        y[j] = (float)k3_exp_d(lb * k3_sig_d(u));
    }
}

#define K3_CONV_KMAX 8 /* the longest conv kernel k3__shortconv8 takes */

/* p[0], p[stride], ..., p[7 * stride] as one vector, built in registers. */
static inline __m256 conv_lanes(const float *p, int64_t stride) {
    return _mm256_setr_ps(p[0], p[stride], p[2 * stride], p[3 * stride], p[4 * stride],
                          p[5 * stride], p[6 * stride], p[7 * stride]);
}

/* shortconv's sums of eight channels (x, w, hist, y offset to the first of them; channel
 * stride 1 in x and y, K in w, K - 1 in hist): the scalar loop of k3avx2_attention.c with the
 * channels in the lanes, float32 products and sums rounded one by one as there (no FMA). The
 * sums go to y; k3_shortconv applies the silu to all of them afterwards. */
static void k3__shortconv8(const float *x, int64_t T, int64_t C, const float *w, int64_t K,
                           float *hist, float *y) {
    __m256 wv[K3_CONV_KMAX], hv[K3_CONV_KMAX];
    float lane[8];
    /* the channels' taps element by element into the lanes (eight scalar stores read back
     * as one vector cannot be forwarded from the store queue) */
    for (int64_t j = 0; j < K; ++j) wv[j] = conv_lanes(w + j, K);
    for (int64_t j = 0; j < K - 1; ++j) hv[j] = conv_lanes(hist + j, K - 1);
    for (int64_t t = 0; t < T; ++t) {
        const __m256 xt = _mm256_loadu_ps(x + t * C);
        __m256 acc = _mm256_mul_ps(wv[K - 1], xt);
        for (int64_t j = 0; j < K - 1; ++j) acc = _mm256_add_ps(acc, _mm256_mul_ps(wv[j], hv[j]));
        if (K > 1) {
            for (int64_t j = 0; j + 1 < K - 1; ++j) hv[j] = hv[j + 1];
            hv[K - 2] = xt;
        }
        _mm256_storeu_ps(y + t * C, acc);
    }
    for (int64_t j = 0; j < K - 1; ++j) {
        _mm256_storeu_ps(lane, hv[j]);
        for (int l = 0; l < 8; ++l) hist[l * (K - 1) + j] = lane[l];
    }
}
