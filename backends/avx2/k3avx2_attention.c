/* k3avx2_attention.c - shortconv, kda_gate, kda_recurrent, mla_attention,
 * mla_latent_attention and attn_res
 * (k3core/api/kernels.py "attention building blocks"). Channels, heads or tokens are split
 * across threads; every lane sum runs on one thread in the contract's order. */
#include "k3avx2_internal.h"

/* ---- shortconv: per channel, float32 ------------------------------------------------- */
typedef struct {
    const float *x, *w;
    int64_t T, C, K, c0; /* c0: the first channel of the scalar loop */
    float *hist, *y;
} conv_job;

/* Blocks [b0, b1) of eight channels. */
static void conv8_fn(void *ctx, int64_t b0, int64_t b1) {
    const conv_job *j = (const conv_job *)ctx;
    const int64_t K = j->K;
    for (int64_t b = b0; b < b1; ++b)
        k3__shortconv8(j->x + 8 * b, j->T, j->C, j->w + 8 * b * K, K, j->hist + 8 * b * (K - 1),
                       j->y + 8 * b);
}

/* Channels c0 + [i0, i1), one at a time. */
static void conv1_fn(void *ctx, int64_t i0, int64_t i1) {
    const conv_job *j = (const conv_job *)ctx;
    const int64_t T = j->T, C = j->C, K = j->K;
    for (int64_t c = j->c0 + i0; c < j->c0 + i1; ++c) {
        const float *wc = j->w + c * K;
        float *hc = j->hist + c * (K - 1);
        for (int64_t t = 0; t < T; ++t) {
            float xt = j->x[t * C + c];
            float acc = wc[K - 1] * xt;
            for (int64_t i = 0; i < K - 1; ++i) acc = acc + wc[i] * hc[i];
            if (K > 1) {
                for (int64_t i = 0; i + 1 < K - 1; ++i) hc[i] = hc[i + 1];
                hc[K - 2] = xt;
            }
            j->y[t * C + c] = acc;
        }
    }
}

void k3_shortconv(const float *x, int64_t T, int64_t C, const float *w, int64_t K, float *hist,
                  float *y) {
    /* the sums first, eight channels in the lanes (k3avx2_vexp256.c k3__shortconv8), the
     * same float32 operations in the same order, so the same bits; the channels past a
     * multiple of 8 take the scalar loop. Then the silu of every sum in place, as k3_silu
     * (several vectors' chains side by side; taken per eight channels as they came, one
     * pair of chains ran at a time and the core waited on their latency) */
    const int64_t vec = K >= 1 && K <= K3_CONV_KMAX ? C / 8 : 0;
    conv_job j = {x, w, T, C, K, 8 * vec, hist, y};
    k3__pool_for(K3_BIG(C * T * K, K3_PAR_ELEMENTS), conv8_fn, &j, vec, k3__even_chunk(vec));
    k3__pool_for(K3_BIG((C - 8 * vec) * T * K, K3_PAR_ELEMENTS), conv1_fn, &j, C - 8 * vec,
                 k3__even_chunk(C - 8 * vec));
    k3_silu(y, T * C, y);
}

/* ---- kda_gate: alpha = f32(exp_d(lb * sig_d(exp_d(A_log[h]) * (d(z) + d(dt))))) -------- */
typedef struct {
    const float *z, *dt_bias, *a_log;
    int64_t H, D;
    double lower_bound;
    float *y;
} gate_job;

/* (token, head) pairs [p0, p1). */
static void kda_gate_fn(void *ctx, int64_t p0, int64_t p1) {
    const gate_job *j = (const gate_job *)ctx;
    const int64_t H = j->H, D = j->D, P = H * D;
    for (int64_t tp = p0; tp < p1; ++tp) {
        int64_t t = tp / H, h = tp % H;
        double a = k3_exp_d((double)j->a_log[h]);
        const float *z = j->z + t * P + h * D, *dt = j->dt_bias + h * D;
        float *y = j->y + t * P + h * D;
        if (g_avx512)
            k3__kda_gate512(z, dt, a, j->lower_bound, D, y);
        else
            k3__kda_gate256(z, dt, a, j->lower_bound, D, y);
    }
}

void k3_kda_gate(const float *z, int64_t T, int64_t H, int64_t D, const float *dt_bias,
                 const float *a_log, double lower_bound, float *y) {
    gate_job j = {z, dt_bias, a_log, H, D, lower_bound, y};
    k3__pool_for(K3_BIG(T * H * D, K3_PAR_ELEMENTS), kda_gate_fn, &j, T * H, k3__even_chunk(T * H));
}

/* Column lane sums: out[j] = f32(lsum_i d(a_i) * d(M[i, j])) for every column j, lanes
 * i % 32. acc is scratch of 32 * m doubles; rows must be added in increasing i.
 * `rows` is how many rows will be added: with fewer than 32 only the first `rows` lanes
 * receive a term, so only those are cleared and folded. A lane that received none is +0.0
 * and a lane that did is never -0.0, so adding it changes nothing (docs/kernel-contract.md
 * section 2): the skipped adds are exact no-ops, and attn_res over a handful of sources
 * clears and folds a handful of lanes, not 32. */
static inline int64_t colsum_lanes(int64_t rows) { return rows < 1 ? 1 : rows < 32 ? rows : 32; }

static inline void colsum_begin(double *acc, int64_t m, int64_t rows) {
    memset(acc, 0, (size_t)(colsum_lanes(rows) * m) * sizeof(double));
}

static inline void colsum_add(double *acc, int64_t m, int64_t i, float a, const float *row) {
    const double ai = (double)a;
    double *lane = acc + (i % 32) * m;
    for (int64_t j = 0; j < m; ++j) lane[j] = lane[j] + ai * (double)row[j];
}

static inline void colsum_end(double *acc, int64_t m, float *out, int64_t rows) {
    const int64_t n = colsum_lanes(rows);
    for (int h = 16; h >= 1; h /= 2)
        for (int l = 0; l < h && l + h < n; ++l) {
            double *lo = acc + l * m, *hi = acc + (l + h) * m;
            for (int64_t j = 0; j < m; ++j) lo[j] = lo[j] + hi[j];
        }
    for (int64_t j = 0; j < m; ++j) out[j] = (float)acc[j];
}

K3_AVX512 static void colsum_end512(double *acc, int64_t m, float *out, int64_t rows);

/* ---- kda_recurrent: per token, per head (heads in parallel on the pool) -----------------
 * Two passes over S per token: decay rows and accumulate u = k.S; then update rows and
 * accumulate o = q.S. Each lane still adds its rows in increasing i. On AVX-512 a row is
 * decayed (or updated) and added to its lane in one sweep, sixteen columns at a time: the
 * float32 multiply and add of the state stay separate operations, and the lane update is an
 * FMA, which gives the contract's bits because d(k_i) * d(S[i, j]) is exact in float64. For
 * the first 32 rows a lane starts from +0.0 (an FMA onto a zero register: +0.0 + (-0.0) is
 * +0.0, as the contract's lane start gives), so the lanes need no clearing. Measured on a
 * Zen 4 core, 12 heads of 128 x 128: one token 139 us against 174-180 us for the AVX2 loops
 * on OpenMP, 128 tokens 9.8 ms against 11.8-12.1 ms; on two threads one token takes 105 us
 * (the OpenMP version ran one token on one thread). */
K3_INLINE512 __m512d kda_lane_start(const double *lane, int first) {
    return first ? _mm512_setzero_pd() : _mm512_loadu_pd(lane);
}

/* lane[0..16) += c * d(r) (sixteen new state values), from +0.0 for a first row. */
K3_INLINE512 void kda_lane_add16(double *lane, __m512 r, __m512d c, int first) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(r));
    const __m512d hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
    _mm512_storeu_pd(lane, _mm512_fmadd_pd(c, lo, kda_lane_start(lane, first)));
    _mm512_storeu_pd(lane + 8, _mm512_fmadd_pd(c, hi, kda_lane_start(lane + 8, first)));
}

K3_INLINE512 void kda_decay_row512(float *row, float ai, double ki, double *lane, int64_t m,
                                   int first) {
    const __m512 a = _mm512_set1_ps(ai);
    const __m512d k = _mm512_set1_pd(ki);
    int64_t j = 0;
    for (; j + 16 <= m; j += 16) {
        const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + j), a);
        _mm512_storeu_ps(row + j, r);
        kda_lane_add16(lane + j, r, k, first);
    }
    for (; j < m; ++j) {
        row[j] = row[j] * ai;
        lane[j] = (first ? 0.0 : lane[j]) + ki * (double)row[j];
    }
}

K3_INLINE512 void kda_update_row512(float *row, float ki, const float *w, double qi,
                                    double *lane, int64_t m, int first) {
    const __m512 k = _mm512_set1_ps(ki);
    const __m512d q = _mm512_set1_pd(qi);
    int64_t j = 0;
    for (; j + 16 <= m; j += 16) {
        const __m512 r =
            _mm512_add_ps(_mm512_loadu_ps(row + j), _mm512_mul_ps(k, _mm512_loadu_ps(w + j)));
        _mm512_storeu_ps(row + j, r);
        kda_lane_add16(lane + j, r, q, first);
    }
    for (; j < m; ++j) {
        row[j] = row[j] + ki * w[j];
        lane[j] = (first ? 0.0 : lane[j]) + qi * (double)row[j];
    }
}

typedef struct {
    const float *q, *k, *v, *alpha, *beta;
    int64_t T, H, Dk, Dv, chunk;
    float *state, *out;
    double *scratch; /* per chunk of heads: 32 * Dv lane doubles, then 2 * Dv floats */
} kda_job;

/* Head h for every token on AVX-512 (the row sweeps inline here). */
K3_AVX512 static void kda_head512(const kda_job *j, int64_t h, double *acc, float *u, float *w) {
    const int64_t T = j->T, H = j->H, Dk = j->Dk, Dv = j->Dv;
    float *S = j->state + h * Dk * Dv;
    for (int64_t t = 0; t < T; ++t) {
        const float *qt = j->q + (t * H + h) * Dk, *kt = j->k + (t * H + h) * Dk;
        const float *vt = j->v + (t * H + h) * Dv, *at = j->alpha + (t * H + h) * Dk;
        const float bt = j->beta[t * H + h];
        for (int64_t i = 0; i < Dk; ++i)
            kda_decay_row512(S + i * Dv, at[i], (double)kt[i], acc + (i % 32) * Dv, Dv, i < 32);
        colsum_end512(acc, Dv, u, Dk);
        for (int64_t c = 0; c < Dv; ++c) w[c] = bt * (vt[c] - u[c]);
        for (int64_t i = 0; i < Dk; ++i)
            kda_update_row512(S + i * Dv, kt[i], w, (double)qt[i], acc + (i % 32) * Dv, Dv, i < 32);
        colsum_end512(acc, Dv, j->out + (t * H + h) * Dv, Dk);
    }
}

/* The same sweeps with AVX2 (eight float32 state values, two four-lane FMAs at a time). */
static inline __m256d kda_lane_start256(const double *lane, int first) {
    return first ? _mm256_setzero_pd() : _mm256_loadu_pd(lane);
}

/* lane[0..8) += c * d(r) (eight new state values), from +0.0 for a first row. */
static inline void kda_lane_add8(double *lane, __m256 r, __m256d c, int first) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(r));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1));
    _mm256_storeu_pd(lane, _mm256_fmadd_pd(c, lo, kda_lane_start256(lane, first)));
    _mm256_storeu_pd(lane + 4, _mm256_fmadd_pd(c, hi, kda_lane_start256(lane + 4, first)));
}

static inline void kda_decay_row256(float *row, float ai, double ki, double *lane, int64_t m,
                                    int first) {
    const __m256 a = _mm256_set1_ps(ai);
    const __m256d k = _mm256_set1_pd(ki);
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + j), a);
        _mm256_storeu_ps(row + j, r);
        kda_lane_add8(lane + j, r, k, first);
    }
    for (; j < m; ++j) {
        row[j] = row[j] * ai;
        lane[j] = (first ? 0.0 : lane[j]) + ki * (double)row[j];
    }
}

static inline void kda_update_row256(float *row, float ki, const float *w, double qi,
                                     double *lane, int64_t m, int first) {
    const __m256 k = _mm256_set1_ps(ki);
    const __m256d q = _mm256_set1_pd(qi);
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256 r =
            _mm256_add_ps(_mm256_loadu_ps(row + j), _mm256_mul_ps(k, _mm256_loadu_ps(w + j)));
        _mm256_storeu_ps(row + j, r);
        kda_lane_add8(lane + j, r, q, first);
    }
    for (; j < m; ++j) {
        row[j] = row[j] + ki * w[j];
        lane[j] = (first ? 0.0 : lane[j]) + qi * (double)row[j];
    }
}

/* Head h for every token on AVX2: kda_head512's sweeps, four float64 lanes at a time. A
 * head of fewer than 32 rows folds only the lanes its rows started (colsum_end). */
static void kda_head256(const kda_job *j, int64_t h, double *acc, float *u, float *w) {
    const int64_t T = j->T, H = j->H, Dk = j->Dk, Dv = j->Dv;
    float *S = j->state + h * Dk * Dv;
    for (int64_t t = 0; t < T; ++t) {
        const float *qt = j->q + (t * H + h) * Dk, *kt = j->k + (t * H + h) * Dk;
        const float *vt = j->v + (t * H + h) * Dv, *at = j->alpha + (t * H + h) * Dk;
        const float bt = j->beta[t * H + h];
        for (int64_t i = 0; i < Dk; ++i)
            kda_decay_row256(S + i * Dv, at[i], (double)kt[i], acc + (i % 32) * Dv, Dv, i < 32);
        colsum_end(acc, Dv, u, Dk);
        for (int64_t c = 0; c < Dv; ++c) w[c] = bt * (vt[c] - u[c]);
        for (int64_t i = 0; i < Dk; ++i)
            kda_update_row256(S + i * Dv, kt[i], w, (double)qt[i], acc + (i % 32) * Dv, Dv, i < 32);
        colsum_end(acc, Dv, j->out + (t * H + h) * Dv, Dk);
    }
}

/* Heads [h0, h1) for every token, with the scratch of the chunk that starts at h0. */
static void kda_job_fn(void *ctx, int64_t h0, int64_t h1) {
    const kda_job *j = (const kda_job *)ctx;
    const int64_t Dv = j->Dv;
    double *acc = j->scratch + (h0 / j->chunk) * (33 * Dv);
    float *u = (float *)(acc + 32 * Dv), *w = u + Dv;
    for (int64_t h = h0; h < h1; ++h) {
        if (g_avx512)
            kda_head512(j, h, acc, u, w);
        else
            kda_head256(j, h, acc, u, w);
    }
}

int k3_kda_recurrent(const float *q, const float *k, const float *v, const float *alpha,
                     const float *beta, int64_t T, int64_t H, int64_t Dk, int64_t Dv,
                     float *state, float *out) {
    if (H <= 0) return 0;
    /* one chunk of heads per thread (each with its own scratch), on the matrix products'
     * pool: a late helper's chunk is taken by the caller */
    const int par = K3_BIG(T * H * Dk * Dv, K3_PAR_MATMUL);
    const int threads = par ? k3__threads() : 1;
    const int64_t chunk = k3__forced() ? 1 : (H + threads - 1) / threads;
    const int64_t chunks = (H + chunk - 1) / chunk;
    double *scratch = (double *)k3__alloc((size_t)(chunks * 33 * Dv) * sizeof(double));
    if (!scratch) return K3_ENOMEM;
    kda_job j = {q, k, v, alpha, beta, T, H, Dk, Dv, chunk, state, out, scratch};
    if (par)
        k3__pool_run(kda_job_fn, &j, H, chunk, k3__threads());
    else
        kda_job_fn(&j, 0, H);
    k3__free(scratch);
    return 0;
}

/* lane_colsum over `rows` rows of a strided matrix (row i at M + i * ld). */
static void lane_colsum(const float *a, const float *M, int64_t rows, int64_t m, int64_t ld,
                        double *acc, float *out) {
    colsum_begin(acc, m, rows);
    for (int64_t i = 0; i < rows; ++i) colsum_add(acc, m, i, a[i], M + i * ld);
    colsum_end(acc, m, out, rows);
}

/* Add d-products of a (already float64) and b (float32) for one 32-term chunk. */
static inline void lanes_dot32_df(k3_lanes *L, const double *a, const float *b) {
    for (int k = 0; k < 8; ++k)
        L->a[k] = _mm256_add_pd(L->a[k], _mm256_mul_pd(_mm256_loadu_pd(a + 4 * k),
                                                       _mm256_cvtps_pd(_mm_loadu_ps(b + 4 * k))));
}

/* lsum_i ad[i] * d(b[i]) where b is the concatenation of b1[0, n1) and b2[0, n2) and ad
 * is float64, zero padded to a multiple of 32. */
static double dot_split(const double *ad, const float *b1, int64_t n1, const float *b2, int64_t n2) {
    k3_lanes L;
    k3_lanes_zero(&L);
    int64_t n = n1 + n2;
    for (int64_t c = 0; c < n; c += 32) {
        if (c + 32 <= n1) {
            lanes_dot32_df(&L, ad + c, b1 + c);
        } else if (c >= n1 && c + 32 <= n) {
            lanes_dot32_df(&L, ad + c, b2 + (c - n1));
        } else {
            float tb[32] = {0};
            for (int64_t i = c; i < c + 32 && i < n; ++i) tb[i - c] = i < n1 ? b1[i] : b2[i - n1];
            lanes_dot32_df(&L, ad + c, tb);
        }
    }
    return k3_lanes_fold(&L);
}

/* The contract's softmax of score[0, n) into p (float32); e is float64 scratch. */
/* The softmax's shift: the largest score, or the first NaN. */
static inline float softmax_max(const float *score, int64_t n) {
    float m = score[0];
    for (int64_t s = 0; s < n; ++s) {
        if (isnan(score[s])) return score[s];
        if (score[s] > m) m = score[s];
    }
    return m;
}

static void softmax_f32(const float *score, int64_t n, double *e, float *p) {
    const float m = softmax_max(score, n);
    for (int64_t s = 0; s < n; ++s) e[s] = k3_exp_d((double)score[s] - (double)m);
    double z = k3_lsum_d(e, n);
    for (int64_t s = 0; s < n; ++s) p[s] = (float)(e[s] / z);
}

/* ---- mla_attention: queries at pos0 + t attend to positions s <= pos0 + t ------------ */
typedef struct {
    const float *q, *k_nope, *k_rope, *v;
    int64_t H, n, r, dv, pos0;
    double scale;
    float *out;
    atomic_int err;
} mla_job;

/* (token, head) pairs [i0, i1), with scratch of their own (a claim is one pair: later
 * tokens attend to more positions, so claims of one balance the threads). */
static void mla_fn(void *ctx, int64_t i0, int64_t i1) {
    mla_job *j = (mla_job *)ctx;
    const int64_t H = j->H, n = j->n, r = j->r, dv = j->dv, qh = n + r;
    const int64_t npos = j->pos0 + (i1 - 1) / H + 1; /* the claim's longest row */
    float *score = (float *)k3__alloc((size_t)npos * sizeof(float) * 2);
    double *e = (double *)k3__alloc((size_t)npos * sizeof(double));
    double *acc = (double *)k3__alloc((size_t)(32 * dv) * sizeof(double));
    double *qd = (double *)k3__alloc((size_t)((qh + 31) & ~(int64_t)31) * sizeof(double));
    if (score && e && acc && qd) {
        for (int64_t th = i0; th < i1; ++th) {
            int64_t t = th / H, h = th % H, len = j->pos0 + t + 1;
            float *p = score + npos;
            const float *qv = j->q + (t * H + h) * qh;
            for (int64_t i = 0; i < ((qh + 31) & ~(int64_t)31); ++i)
                qd[i] = i < qh ? (double)qv[i] : 0.0;
            for (int64_t s = 0; s < len; ++s)
                score[s] = (float)(dot_split(qd, j->k_nope + (s * H + h) * n, n,
                                             j->k_rope + s * r, r) * j->scale);
            softmax_f32(score, len, e, p);
            lane_colsum(p, j->v + h * dv, len, dv, H * dv, acc, j->out + (t * H + h) * dv);
        }
    } else {
        atomic_store(&j->err, 1);
    }
    k3__free(score);
    k3__free(e);
    k3__free(acc);
    k3__free(qd);
}

int k3_mla_attention(const float *q, const float *k_nope, const float *k_rope, const float *v,
                     int64_t T, int64_t H, int64_t n, int64_t r, int64_t dv, int64_t S,
                     int64_t pos0, double scale, float *out) {
    (void)S; /* the caller checked pos0 + T <= S */
    const int64_t npos = pos0 + T, qh = n + r;
    mla_job j = {q, k_nope, k_rope, v, H, n, r, dv, pos0, scale, out, 0};
    k3__pool_for(K3_BIG(T * H * npos * qh, K3_PAR_ATTENTION), mla_fn, &j, T * H, 1);
    return atomic_load(&j.err) ? K3_ENOMEM : 0;
}

/* ---- mla_latent_attention: absorbed MLA over the latent cache ------------------------
 * One (token, head) per task. q_lat = f32(lsum_i q_nope[i] W_k[h][i, :]) as column lane
 * sums (lane i % 32, whole rows of W_k added in increasing i); scores over [q_lat|q_rope]
 * . cache[s]; softmax; o_lat = f32(lsum_s p[s] latent[s, :]) as column lane sums (lane
 * s % 32); o[j] = f32(dot(W_v[h][j, :], o_lat)) by the matrix-row kernels. With AVX-512
 * (k3_use_avx512) a task is a thread's share of one token's heads, on zmm registers
 * (latent_heads512 below). */
static inline void colsum_add_w(double *acc, int64_t m, int64_t i, float a, const void *w,
                                int kind) {
    const double ai = (double)a;
    double *lane = acc + (i % 32) * m;
    if (kind == K3_W_BF16) {
        const uint16_t *row = (const uint16_t *)w;
        for (int64_t j = 0; j < m; ++j) {
            union { uint32_t u; float f; } v = {(uint32_t)row[j] << 16};
            lane[j] = lane[j] + ai * (double)v.f;
        }
    } else {
        const float *row = (const float *)w;
        for (int64_t j = 0; j < m; ++j) lane[j] = lane[j] + ai * (double)row[j];
    }
}

/* The AVX-512 variants (chosen with the matrix products' switch, k3_use_avx512): the same
 * elementwise lane updates eight columns at a time. Multiplies and adds are separate, as
 * in the AVX2 code, so both paths give the same bits. */
K3_AVX512 static void colsum_add512(double *acc, int64_t m, int64_t i, float a, const void *w,
                                    int kind) {
    const double ai = (double)a;
    const __m512d av = _mm512_set1_pd(ai);
    double *lane = acc + (i % 32) * m;
    int64_t j = 0;
    if (kind == K3_W_BF16) {
        const uint16_t *row = (const uint16_t *)w;
        for (; j + 8 <= m; j += 8) {
            __m256i b32 = _mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + j))), 16);
            __m512d r = _mm512_cvtps_pd(_mm256_castsi256_ps(b32));
            _mm512_storeu_pd(lane + j, _mm512_add_pd(_mm512_loadu_pd(lane + j),
                                                     _mm512_mul_pd(av, r)));
        }
        for (; j < m; ++j) {
            union { uint32_t u; float f; } v = {(uint32_t)row[j] << 16};
            lane[j] = lane[j] + ai * (double)v.f;
        }
    } else {
        const float *row = (const float *)w;
        for (; j + 8 <= m; j += 8) {
            __m512d r = _mm512_cvtps_pd(_mm256_loadu_ps(row + j));
            _mm512_storeu_pd(lane + j, _mm512_add_pd(_mm512_loadu_pd(lane + j),
                                                     _mm512_mul_pd(av, r)));
        }
        for (; j < m; ++j) lane[j] = lane[j] + ai * (double)row[j];
    }
}

K3_AVX512 static void colsum_end512(double *acc, int64_t m, float *out, int64_t rows) {
    const int64_t n = colsum_lanes(rows);
    for (int h = 16; h >= 1; h /= 2)
        for (int l = 0; l < h && l + h < n; ++l) {
            double *lo = acc + l * m, *hi = acc + (l + h) * m;
            int64_t j = 0;
            for (; j + 8 <= m; j += 8)
                _mm512_storeu_pd(lo + j, _mm512_add_pd(_mm512_loadu_pd(lo + j),
                                                       _mm512_loadu_pd(hi + j)));
            for (; j < m; ++j) lo[j] = lo[j] + hi[j];
        }
    for (int64_t j = 0; j < m; ++j) out[j] = (float)acc[j];
}

typedef struct {
    const float *q, *cache;
    const void *w;
    int kind;
    int64_t H, n, C, r, dv, pos0;
    double scale;
    float *out;
    atomic_int err;
} latent_job;

/* ---- the heads of one token together (AVX-512) ------------------------------------------
 * Per head the sums are the ones above, lane for lane and in the same order, but the loops
 * over positions are outermost: each cache row, read once from memory, serves every head of
 * the group (one token's heads in a claim), where head by head every head had read the whole
 * cache twice (at 32K positions, 25 MB a layer, twelve heads read 600 MB a layer from
 * DRAM). The score dot takes the query widened once and each row widened once for all heads
 * (latent_scores512); the softmax's exponentials run eight lanes at a time (v_exp_d:
 * k3_exp_d operation for operation); the weighted sum of the latent rows keeps each lane in
 * registers over all of its positions (latent_wsum512: a lane's terms are the positions
 * s = l, l + 32, ..., so it runs down them in order and is stored once, where adding row by
 * row loaded and stored every lane at every position). Its lanes go in column blocks of
 * LATENT_CB before they are folded (each column's lanes are the same sums whichever block
 * holds them). The cache is read on huge pages where the kernel gives them
 * (k3core/model/state.py): down a lane the rows are 32 apart, a page each on small pages. */
#define LATENT_CB 128  /* latent columns a colsum pass keeps (32 lanes x 128 doubles a head) */
#define LATENT_GROUP 16 /* heads at most in one group */

/* softmax_f32 with the exponentials eight at a time (the same values). */
K3_AVX512 static void softmax512(const float *score, int64_t n, double *e, float *p) {
    const float m = softmax_max(score, n);
    const __m512d md = _mm512_set1_pd((double)m);
    int64_t s = 0;
    for (; s + 8 <= n; s += 8)
        _mm512_storeu_pd(e + s, v_exp_d(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(score + s)), md)));
    for (; s < n; ++s) e[s] = k3_exp_d((double)score[s] - (double)m);
    double z = k3_lsum_d(e, n);
    for (s = 0; s < n; ++s) p[s] = (float)(e[s] / z);
}

/* The scores of heads [0, k) at position s with the cache row in registers: the row's
 * 32-column blocks b0 .. b0 + NB - 1 are widened once into R (the last block of the row,
 * nb - 1, loaded under `tm`'s masks), then each head's four lane registers L (zero at
 * b0 == 0, else its saved `Ls`) add the blocks in order. The sum is k3_dot_f32's: lane i % 32
 * of the widened query (padded with +0.0 to whole blocks) times the widened row (+0.0 past
 * cr), one FMA a term (the products of two floats are exact in float64), the lanes folded by
 * fold512 after the row's last block. */
K3_INLINE512 void score_chunk(const double *qd, int64_t crp, int64_t k, const float *row,
                              int64_t b0, const int NB, int64_t nb, const __mmask8 *tm,
                              double *Ls, float *sc, int64_t npos, double scale) {
    __m512d R[24];
#pragma GCC unroll 6
    for (int b = 0; b < NB; ++b) {
        const float *at = row + 32 * (b0 + b);
        if (b0 + b == nb - 1)
            for (int kk = 0; kk < 4; ++kk)
                R[4 * b + kk] = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(tm[kk], at + 8 * kk));
        else
            for (int kk = 0; kk < 4; ++kk)
                R[4 * b + kk] = _mm512_cvtps_pd(_mm256_loadu_ps(at + 8 * kk));
    }
    const int first = b0 == 0, last = b0 + NB == nb;
    for (int64_t i = 0; i < k; ++i) {
        const double *q = qd + i * crp + 32 * b0;
        double *ls = Ls + 32 * i;
        __m512d L0, L1, L2, L3;
        if (first) {
            L0 = L1 = L2 = L3 = _mm512_setzero_pd();
        } else {
            L0 = _mm512_loadu_pd(ls); L1 = _mm512_loadu_pd(ls + 8);
            L2 = _mm512_loadu_pd(ls + 16); L3 = _mm512_loadu_pd(ls + 24);
        }
#pragma GCC unroll 6
        for (int b = 0; b < NB; ++b) {
            L0 = _mm512_fmadd_pd(_mm512_loadu_pd(q + 32 * b), R[4 * b], L0);
            L1 = _mm512_fmadd_pd(_mm512_loadu_pd(q + 32 * b + 8), R[4 * b + 1], L1);
            L2 = _mm512_fmadd_pd(_mm512_loadu_pd(q + 32 * b + 16), R[4 * b + 2], L2);
            L3 = _mm512_fmadd_pd(_mm512_loadu_pd(q + 32 * b + 24), R[4 * b + 3], L3);
        }
        if (last) {
            sc[i * npos] = (float)(fold512(L0, L1, L2, L3) * scale);
        } else {
            _mm512_storeu_pd(ls, L0); _mm512_storeu_pd(ls + 8, L1);
            _mm512_storeu_pd(ls + 16, L2); _mm512_storeu_pd(ls + 24, L3);
        }
    }
}

/* score[i * npos + s] for heads [0, k) and positions [0, len), each cache row read and
 * widened once for every head (up to six 32-column blocks a pass in registers). Head by head
 * the row was widened again for every head, and the lanes' latency chains ran one head at a
 * time. */
K3_AVX512 static void latent_scores512(const double *qd, int64_t crp, int64_t k,
                                       const float *cache, int64_t cr, int64_t len,
                                       double scale, float *score, int64_t npos, double *Ls) {
    const int64_t nb = (cr + 31) / 32;
    __mmask8 tm[4];
    for (int kk = 0; kk < 4; ++kk) {
        const int64_t left = cr - 32 * (nb - 1) - 8 * kk;
        tm[kk] = left >= 8 ? 0xFF : left <= 0 ? 0 : (__mmask8)((1u << left) - 1u);
    }
    for (int64_t s = 0; s < len; ++s) {
        const float *row = cache + s * cr;
        for (int64_t b0 = 0; b0 < nb; b0 += 6) {
            switch (nb - b0 < 6 ? nb - b0 : 6) {
            case 1: score_chunk(qd, crp, k, row, b0, 1, nb, tm, Ls, score + s, npos, scale); break;
            case 2: score_chunk(qd, crp, k, row, b0, 2, nb, tm, Ls, score + s, npos, scale); break;
            case 3: score_chunk(qd, crp, k, row, b0, 3, nb, tm, Ls, score + s, npos, scale); break;
            case 4: score_chunk(qd, crp, k, row, b0, 4, nb, tm, Ls, score + s, npos, scale); break;
            case 5: score_chunk(qd, crp, k, row, b0, 5, nb, tm, Ls, score + s, npos, scale); break;
            default: score_chunk(qd, crp, k, row, b0, 6, nb, tm, Ls, score + s, npos, scale); break;
            }
        }
    }
}

/* Heads i0 .. i0 + KB - 1, sixteen latent columns [c, c + w) (w <= 16; masks m0, m1): lane
 * l of each head is colsum_add512's lane l (its terms p[s] * latent[s, c + j], multiply then
 * add, s = l, l + 32, ... in increasing order, from +0.0) kept in registers over all of its
 * positions and stored once into the head's lanes (`acc`, row stride m, column `coff`).
 * p is pd[s * k + i]: the probabilities widened, position-major. */
#define WSUM_AHEAD 8 /* a lane's positions ahead its rows are prefetched (32 rows apart) */
K3_INLINE512 void wsum_heads(const double *pd, int64_t k, int64_t i0, const int KB,
                             const float *cache, int64_t cr, int64_t len, int64_t c,
                             __mmask8 m0, __mmask8 m1, double *acc, int64_t m, int64_t coff) {
    const int64_t lanes = colsum_lanes(len);
    for (int64_t l = 0; l < lanes; ++l) {
        __m512d A[12][2];
#pragma GCC unroll 12
        for (int h = 0; h < KB; ++h) A[h][0] = A[h][1] = _mm512_setzero_pd();
        for (int64_t s = l; s < len; s += 32) {
            const float *row = cache + s * cr + c;
            _mm_prefetch((const char *)(row + 32 * WSUM_AHEAD * cr), _MM_HINT_T0);
            const __m512d r0 = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m0, row));
            const __m512d r1 = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m1, row + 8));
            const double *p = pd + s * k + i0;
#pragma GCC unroll 12
            for (int h = 0; h < KB; ++h) {
                const __m512d pv = _mm512_set1_pd(p[h]);
                A[h][0] = _mm512_add_pd(A[h][0], _mm512_mul_pd(pv, r0));
                A[h][1] = _mm512_add_pd(A[h][1], _mm512_mul_pd(pv, r1));
            }
        }
#pragma GCC unroll 12
        for (int h = 0; h < KB; ++h) {
            double *to = acc + (i0 + h) * 32 * LATENT_CB + l * m + coff;
            _mm512_mask_storeu_pd(to, m0, A[h][0]);
            _mm512_mask_storeu_pd(to + 8, m1, A[h][1]);
        }
    }
}

/* o_lat's lanes of every head for the latent columns [c0, c0 + m) (m <= LATENT_CB), into
 * acc (head i at i * 32 * LATENT_CB, lane l at l * m): heads twelve at most a pass. */
K3_AVX512 static void latent_wsum512(const double *pd, int64_t k, const float *cache,
                                     int64_t cr, int64_t len, int64_t c0, int64_t m,
                                     double *acc) {
    for (int64_t coff = 0; coff < m; coff += 16) {
        const int64_t w = m - coff < 16 ? m - coff : 16;
        const __mmask8 m0 = w >= 8 ? 0xFF : (__mmask8)((1u << w) - 1u);
        const __mmask8 m1 = w >= 16 ? 0xFF : w <= 8 ? 0 : (__mmask8)((1u << (w - 8)) - 1u);
        for (int64_t i0 = 0; i0 < k; i0 += 12) {
            const int64_t c = c0 + coff;
            switch (k - i0 < 12 ? k - i0 : 12) {
#define WSUM_CASE(n) case n: wsum_heads(pd, k, i0, n, cache, cr, len, c, m0, m1, acc, m, coff); break;
            WSUM_CASE(1) WSUM_CASE(2) WSUM_CASE(3) WSUM_CASE(4) WSUM_CASE(5) WSUM_CASE(6)
            WSUM_CASE(7) WSUM_CASE(8) WSUM_CASE(9) WSUM_CASE(10) WSUM_CASE(11)
            default: wsum_heads(pd, k, i0, 12, cache, cr, len, c, m0, m1, acc, m, coff); break;
#undef WSUM_CASE
            }
        }
    }
}

/* Heads h0 .. h0 + k - 1 of token t; `sc` scratch of latent_scratch512's size. */
K3_AVX512 static void latent_heads512(const latent_job *j, int64_t t, int64_t h0, int64_t k,
                                      char *sc, int64_t npos) {
    const int64_t H = j->H, n = j->n, C = j->C, r = j->r, dv = j->dv;
    const int64_t cr = C + r, qh = n + r, hw = n + dv, kind = j->kind, len = j->pos0 + t + 1;
    const int64_t crp = (cr + 31) & ~(int64_t)31, cpad = (C + 31) & ~(int64_t)31;
    const size_t esz = kind == K3_W_BF16 ? sizeof(uint16_t) : sizeof(float);
    double *qd = (double *)sc;                      /* k x crp */
    double *acc = qd + k * crp;                     /* k x 32 x LATENT_CB */
    double *e = acc + k * 32 * LATENT_CB;           /* npos */
    double *od = e + npos;                          /* cpad */
    double *lanes = od + cpad;                      /* 32 x C: q_lat's lanes */
    float *score = (float *)(lanes + 32 * C);       /* k x npos */
    float *pr = score + k * npos;                   /* k x npos */
    float *qq = pr + k * npos;                      /* C: one head's q_lat */
    float *olat = qq + C;                           /* k x C */
    double *pd = (double *)(((uintptr_t)(olat + k * C) + 63) & ~(uintptr_t)63); /* npos x k */
    for (int64_t i = 0; i < k; ++i) { /* q_lat of each head, widened with its rope part */
        const float *qv = j->q + (t * H + h0 + i) * qh;
        const char *wh = (const char *)j->w + (size_t)((h0 + i) * hw) * (size_t)C * esz;
        colsum_begin(lanes, C, n);
        for (int64_t c = 0; c < n; ++c)
            colsum_add512(lanes, C, c, qv[c], wh + (size_t)(c * C) * esz, (int)kind);
        colsum_end512(lanes, C, qq, n);
        double *q = qd + i * crp;
        for (int64_t c = 0; c < crp; ++c)
            q[c] = c < C ? (double)qq[c] : c < cr ? (double)qv[n + c - C] : 0.0;
    }
    /* scores: each row read and widened once for every head (its lanes kept in `acc`
     * between the row's passes of six blocks) */
    latent_scores512(qd, crp, k, j->cache, cr, len, j->scale, score, npos, acc);
    for (int64_t i = 0; i < k; ++i) softmax512(score + i * npos, len, e, pr + i * npos);
    for (int64_t s = 0; s < len; ++s) /* the probabilities widened, position-major */
        for (int64_t i = 0; i < k; ++i) pd[s * k + i] = (double)pr[i * npos + s];
    for (int64_t c0 = 0; c0 < C; c0 += LATENT_CB) { /* o_lat, a column block at a time */
        const int64_t m = C - c0 < LATENT_CB ? C - c0 : LATENT_CB;
        latent_wsum512(pd, k, j->cache, cr, len, c0, m, acc);
        for (int64_t i = 0; i < k; ++i)
            colsum_end512(acc + i * 32 * LATENT_CB, m, olat + i * C + c0, len);
    }
    for (int64_t i = 0; i < k; ++i) {
        for (int64_t c = 0; c < cpad; ++c) od[c] = c < C ? (double)olat[i * C + c] : 0.0;
        const char *wh = (const char *)j->w + (size_t)((h0 + i) * hw) * (size_t)C * esz;
        float *o = j->out + (t * H + h0 + i) * dv;
        for (int64_t c = 0; c < dv; ++c) {
            const char *row = wh + (size_t)((n + c) * C) * esz;
            o[c] = kind == K3_W_BF16 ? row_bf16((const uint16_t *)row, C, od)
                                     : row_f32((const float *)row, C, od);
        }
    }
}

static size_t latent_scratch512(int64_t k, int64_t C, int64_t r, int64_t npos) {
    const int64_t crp = (C + r + 31) & ~(int64_t)31, cpad = (C + 31) & ~(int64_t)31;
    return (size_t)(k * crp + k * 32 * LATENT_CB + npos + cpad + 32 * C) * sizeof(double)
           + (size_t)(2 * k * npos + C + k * C) * sizeof(float) + 64
           + (size_t)(npos * k) * sizeof(double);
}

/* (token, head) pairs [i0, i1): with AVX-512 each token's heads in the claim together
 * (latent_heads512), else pair by pair below. */
static void latent_fn(void *ctx, int64_t i0, int64_t i1);

static void latent_group_fn(void *ctx, int64_t i0, int64_t i1) {
    latent_job *j = (latent_job *)ctx;
    if (!g_avx512) {
        latent_fn(ctx, i0, i1);
        return;
    }
    const int64_t H = j->H;
    const int64_t most = i1 - i0 < LATENT_GROUP ? i1 - i0 : LATENT_GROUP;
    const int64_t npos = j->pos0 + (i1 - 1) / H + 1; /* the claim's longest row */
    char *sc = (char *)k3__alloc(latent_scratch512(most, j->C, j->r, npos));
    if (!sc) {
        atomic_store(&j->err, 1);
        return;
    }
    for (int64_t th = i0; th < i1;) {
        const int64_t t = th / H, h = th % H;
        int64_t k = (t + 1) * H - th; /* this token's heads left in the claim */
        if (k > i1 - th) k = i1 - th;
        if (k > most) k = most;
        latent_heads512(j, t, h, k, sc, npos);
        th += k;
    }
    k3__free(sc);
}

/* (token, head) pairs [i0, i1), with scratch of their own: the AVX2 code (without
 * k3_use_avx512; with it every claim goes to latent_heads512). */
static void latent_fn(void *ctx, int64_t i0, int64_t i1) {
    latent_job *j = (latent_job *)ctx;
    const int64_t H = j->H, n = j->n, C = j->C, r = j->r, dv = j->dv;
    const int64_t cr = C + r, qh = n + r, hw = n + dv, kind = j->kind;
    const int64_t cpad = (C + 31) & ~(int64_t)31;
    const size_t esz = kind == K3_W_BF16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t npos = j->pos0 + (i1 - 1) / H + 1; /* the claim's longest row */
    float *score = (float *)k3__alloc((size_t)npos * sizeof(float) * 2);
    double *e = (double *)k3__alloc((size_t)npos * sizeof(double));
    double *acc = (double *)k3__alloc((size_t)(32 * C) * sizeof(double));
    float *qq = (float *)k3__alloc((size_t)(cr + C) * sizeof(float));
    double *od = (double *)k3__alloc((size_t)cpad * sizeof(double));
    if (score && e && acc && qq && od) {
        for (int64_t th = i0; th < i1; ++th) {
            int64_t t = th / H, h = th % H, len = j->pos0 + t + 1;
            float *p = score + npos, *olat = qq + cr;
            const float *qv = j->q + (t * H + h) * qh;
            const char *wh = (const char *)j->w + (size_t)(h * hw) * (size_t)C * esz;
            colsum_begin(acc, C, n);
            for (int64_t i = 0; i < n; ++i)
                colsum_add_w(acc, C, i, qv[i], wh + (size_t)(i * C) * esz, (int)kind);
            colsum_end(acc, C, qq, n);
            for (int64_t i = 0; i < r; ++i) qq[C + i] = qv[n + i];
            for (int64_t s = 0; s < len; ++s)
                score[s] = (float)(k3_dot_f32(qq, j->cache + s * cr, cr) * j->scale);
            softmax_f32(score, len, e, p);
            lane_colsum(p, j->cache, len, C, cr, acc, olat);
            for (int64_t c = 0; c < cpad; ++c) od[c] = c < C ? (double)olat[c] : 0.0;
            float *o = j->out + (t * H + h) * dv;
            for (int64_t i = 0; i < dv; ++i) {
                const char *row = wh + (size_t)((n + i) * C) * esz;
                o[i] = kind == K3_W_BF16 ? row_bf16((const uint16_t *)row, C, od)
                                         : row_f32((const float *)row, C, od);
            }
        }
    } else {
        atomic_store(&j->err, 1);
    }
    k3__free(score);
    k3__free(e);
    k3__free(acc);
    k3__free(qq);
    k3__free(od);
}

int k3_mla_latent_attention(const float *q, const float *cache, const void *w, int kind,
                            int64_t T, int64_t H, int64_t n, int64_t C, int64_t r, int64_t dv,
                            int64_t pos0, double scale, float *out) {
    const int64_t npos = pos0 + T, hw = n + dv;
    latent_job j = {q, cache, w, kind, H, n, C, r, dv, pos0, scale, out, 0};
    /* a claim takes a thread's share of a token's heads (one head when forced, so the
     * conformance tests run groups of every size) */
    const int threads = k3__threads() < 1 ? 1 : k3__threads();
    const int64_t chunk = k3__forced() ? 1 : (H + threads - 1) / threads;
    k3__pool_for(K3_BIG(T * H * (npos * (2 * C + r) + hw * C), K3_PAR_ATTENTION), latent_group_fn,
                 &j, T * H, chunk);
    return atomic_load(&j.err) ? K3_ENOMEM : 0;
}

/* ---- attn_res: softmax over sources of f32(dot(rmsnorm(src_s), fold)) ------------------ */
#define AR_COLS 256 /* output columns accumulated at a time (32 x 256 doubles of lanes) */

typedef struct {
    const float *src, *fold;
    int64_t S, T, E;
    double eps;
    float *out;
    atomic_int err;
} attn_res_job;

/* Tokens [t0, t1), with scratch of their own. */
static void attn_res_fn(void *ctx, int64_t t0, int64_t t1) {
    attn_res_job *j = (attn_res_job *)ctx;
    const int64_t S = j->S, T = j->T, E = j->E;
    float *key = (float *)k3__alloc((size_t)E * sizeof(float));
    float *score = (float *)k3__alloc((size_t)S * sizeof(float) * 2);
    double *e = (double *)k3__alloc((size_t)S * sizeof(double));
    double *acc = (double *)k3__alloc((size_t)(32 * AR_COLS) * sizeof(double));
    if (key && score && e && acc) {
        for (int64_t t = t0; t < t1; ++t) {
            float *p = score + S;
            for (int64_t s = 0; s < S; ++s) {
                const float *xs = j->src + (s * T + t) * E;
                float inv = (float)(1.0 / sqrt(k3_sumsq_f32(xs, E) / (double)E + j->eps));
                for (int64_t i = 0; i < E; ++i) key[i] = xs[i] * inv;
                score[s] = (float)k3_dot_f32(key, j->fold, E);
            }
            softmax_f32(score, S, e, p);
            for (int64_t c0 = 0; c0 < E; c0 += AR_COLS) {
                int64_t m = E - c0 < AR_COLS ? E - c0 : AR_COLS;
                lane_colsum(p, j->src + t * E + c0, S, m, T * E, acc, j->out + t * E + c0);
            }
        }
    } else {
        atomic_store(&j->err, 1);
    }
    k3__free(key);
    k3__free(score);
    k3__free(e);
    k3__free(acc);
}

int k3_attn_res(const float *src, int64_t S, int64_t T, int64_t E, const float *fold, double eps,
                float *out) {
    attn_res_job j = {src, fold, S, T, E, eps, out, 0};
    k3__pool_for(K3_BIG(S * T * E, K3_PAR_ATTENTION), attn_res_fn, &j, T, k3__even_chunk(T));
    return atomic_load(&j.err) ? K3_ENOMEM : 0;
}
