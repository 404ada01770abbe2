/* k3avx2_matmul.c - y[t, o] = f32(lsum_i d(W[o, i]) * d(x[t, i])) for bf16, float32 and
 * MXFP4 weights (k3core/api/kernels.py "matmul").
 *
 * Lane order: column i of a row goes to lane i % 32. The 32 float64 lanes live in 8 ymm
 * registers; every product is exact in float64, so only the order of the additions
 * matters, and each lane adds its terms in increasing i starting from +0.0. A column tail
 * (cols % 32 != 0) is completed with +0.0 terms exactly as the reference pads it.
 * Threads split the rows (each output element is computed by exactly one thread).
 *
 * Each row is streamed once per block of tokens (T == 1, the decode case, is bandwidth
 * bound); the other tokens of a block find the row in cache. On AVX-512 CPUs several tokens
 * go through k3avx2_matmul512.c (one decode per chunk for four tokens).
 *
 * The lane update acc + w*x is one FMA: w*x is exact in float64 (a float32 times a bf16,
 * float32 or MXFP4 value), so rounding the sum once is what the contract's separate
 * multiply (exact) and add (rounded) give (docs/kernel-contract.md section 2).
 */
#include "k3avx2_internal.h"

#define ROUND32(n) (((n) + 31) & ~(int64_t)31)
/* float64 activations per token block: well inside L2 (1 MiB on Zen 4) beside the weight
 * rows streaming through, so the multi-token kernels read them from L2, not L3 */
#define XBLOCK_BYTES (640 << 10)
/* Software prefetch into L2 this many bytes ahead of the weight stream. Measured on a
 * Zen 4 core: the hardware prefetchers alone leave a 1-thread bf16 matvec at ~60% of its
 * in-cache speed; an L2 prefetch 4 KiB ahead brings it to ~90%
 * (docs/measurements/2026-11-29-avx2-kernels-zen4.md). */
#define PREFETCH_AHEAD 4096
#define ROW_CHUNK 16 /* rows per scheduling chunk (at least, row_chunk) */
#define ROWS_CLAIMS 4 /* claims per thread of a job at least (row_chunk) */
#define SPAN2_CLAIM_MACS 1500000 /* multiply-adds of a claim of span tiles (row_chunk) */
#define PREFETCH_L2(p) _mm_prefetch((const char *)(p) + PREFETCH_AHEAD, _MM_HINT_T1)

static int g_avx512 = 0;
int k3_use_avx512(int on); /* the CPU runs the AVX-512 multi-token kernels (k3avx2_matmul512.c) */

__attribute__((constructor)) static void k3__pick_avx512(void) { g_avx512 = k3_use_avx512(1); }

/* Use the AVX-512 multi-token kernels when `on` and the CPU has them; returns whether they
 * are used now (a switch for the tests and the benchmark: both paths give the same bits). */
int k3_use_avx512(int on) {
    __builtin_cpu_init();
    g_avx512 = on && k3_has_avx512() && __builtin_cpu_supports("avx512dq");
    return g_avx512;
}


/* y = situ(g, u) elementwise: eight lanes at a time on AVX-512 (k3avx2_vexp512.c), else
 * four (k3avx2_vexp256.c). */
static void k3__situ(const float *g, const float *u, int64_t n, double b1, double b2, float *y) {
    if (g_avx512)
        k3__situ512(g, u, n, b1, b2, y);
    else
        k3__situ256(g, u, n, b1, b2, y);
}

/* ---- activations widened once per token block --------------------------------------- */
/* How a token block is multiplied (use_blocked): the one-token row kernels, the AVX-512
 * lane-pass tiles, the AVX2 tiles, the AVX-512 span tiles (k3avx2_span512.c), the AVX-512
 * one-token tiles (k3avx2_one512.c), or the AVX2 span tiles (k3avx2_span256.c). */
enum {
    K3_PATH_ROWS = 0,
    K3_PATH_512 = 1,
    K3_PATH_256 = 2,
    K3_PATH_SPAN = 3,
    K3_PATH_ONE = 4,
    K3_PATH_SPAN256 = 5
};

/* The order of the widened activations a path reads: natural, MX_PERM within each group of
 * four columns (the MXFP4 rows), pass-major (the AVX-512 span tiles: span_index),
 * eighth-major (the AVX2 span tiles: span256_index; for MXFP4 weights span256_mx_index) or
 * bits 2 and 3 of the column swapped (the AVX-512 one-token bf16 rows: k3avx2_one512.c's
 * unpacked order). */
enum {
    K3_X_NATURAL = 0,
    K3_X_MXPERM = 1,
    K3_X_PASS = 2,
    K3_X_EIGHTH = 3,
    K3_X_EIGHTH_MX = 4,
    K3_X_BF16U = 5
};

static inline int x_order(enum k3_wkind kind, int path) {
    if (path == K3_PATH_ONE && kind == K3_W_BF16) return K3_X_BF16U;
    if (path == K3_PATH_SPAN) return K3_X_PASS;
    if (path == K3_PATH_SPAN256) return kind == K3_W_MXFP4 ? K3_X_EIGHTH_MX : K3_X_EIGHTH;
    return kind == K3_W_MXFP4 && path == K3_PATH_ROWS ? K3_X_MXPERM : K3_X_NATURAL;
}

/* Where column i of a row of cp columns goes in `order`. */
static inline int64_t x_index(int64_t i, int64_t cp, int order) {
    if (order == K3_X_PASS) return span_index(i, cp);
    if (order == K3_X_EIGHTH) return span256_index(i, cp);
    if (order == K3_X_EIGHTH_MX) return span256_mx_index(i, cp);
    if (order == K3_X_MXPERM) return (i & ~(int64_t)3) + MX_PERM[i & 3]; /* its own inverse */
    if (order == K3_X_BF16U) return (i & ~(int64_t)12) | ((i & 4) << 1) | ((i & 8) >> 1);
    return i;
}

/* xd[t, :] = d(x[t, :]) for n tokens, padded with +0.0 to a multiple of 32, in `order`.
 * Whole 32-column groups go four columns a vector: in every order a group's columns land
 * in runs of four (eight for the pass order) consecutive doubles, MX_PERM's runs being
 * (0, 2, 1, 3), one vpermpd. Element by element through x_index it had cost the medium
 * model's 128-id prefill about 0.13 s of the calling thread while the pool waited (2 ns an
 * element on Zen 2; widen_par now splits it between threads too). The group tail goes
 * element by element. */
static void widen_x(double *xd, const float *x, int64_t n, int64_t cols, int64_t cp, int order) {
    const int64_t whole = cols / 32;
    for (int64_t t = 0; t < n; ++t) {
        const float *xs = x + t * cols;
        double *xo = xd + t * cp;
        for (int64_t c = 0; c < whole; ++c) {
            const float *g = xs + 32 * c;
            for (int k = 0; k < 8; ++k) {
                __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(g + 4 * k));
                if (order == K3_X_MXPERM || order == K3_X_EIGHTH_MX)
                    v = _mm256_permute4x64_pd(v, 0xD8); /* MX_PERM: (0, 2, 1, 3) */
                _mm256_storeu_pd(xo + x_index(32 * c + 4 * k, cp, order), v);
            }
        }
        for (int64_t i = 32 * whole; i < cp; ++i)
            xo[x_index(i, cp, order)] = i < cols ? (double)xs[i] : 0.0;
    }
}

/* widen_x on the pool, tokens split between threads, when `par` and there are enough of
 * them (the calling thread would widen them alone while the others wait). */
typedef struct {
    double *xd;
    const float *x;
    int64_t cols, cp;
    int order;
} widen_job;

static void widen_job_fn(void *ctx, int64_t b, int64_t e) {
    const widen_job *j = (const widen_job *)ctx;
    widen_x(j->xd + b * j->cp, j->x + b * j->cols, e - b, j->cols, j->cp, j->order);
}

#define WIDEN_CHUNK 16384 /* elements a claim at least */

static void widen_par(double *xd, const float *x, int64_t n, int64_t cols, int64_t cp, int order,
                      int par) {
    const int64_t chunk = k3__forced() ? 1 : (WIDEN_CHUNK + cp - 1) / cp;
    if (!par || n <= chunk) {
        widen_x(xd, x, n, cols, cp, order);
        return;
    }
    widen_job j = {xd, x, cols, cp, order};
    k3__pool_run(widen_job_fn, &j, n, chunk, k3__threads());
}

/* The path for a block of T tokens: on AVX-512 the span tiles for SPAN_MIN_TOKENS tokens
 * and more, the lane-pass tiles for fewer, the one-token tiles for one; else the AVX2 span
 * tiles from span2_min_tokens on, the AVX2 lane-pass tiles for fewer and the
 * one-token rows for one. Each path reads its activations in x_order's order. */
static inline int use_blocked(enum k3_wkind kind, int64_t T) {
    if (g_avx512) {
        if (T >= SPAN_MIN_TOKENS) return K3_PATH_SPAN;
        return T >= 2 ? K3_PATH_512 : K3_PATH_ONE;
    }
    if (T >= span2_min_tokens(kind)) return K3_PATH_SPAN256;
    return T >= 2 ? K3_PATH_256 : K3_PATH_ROWS;
}

static int64_t token_block(enum k3_wkind kind, int64_t T, int64_t cp) {
    /* the span tiles keep a span's weights in L2 and stream the activations past them, a
     * tile of tokens at a time: their blocks may be larger than L2 (SPAN2_XBLOCK_BYTES,
     * SPAN_XBLOCK_BYTES) */
    const int path = use_blocked(kind, T);
    const int64_t bytes = path == K3_PATH_SPAN256 ? SPAN2_XBLOCK_BYTES
                          : path == K3_PATH_SPAN  ? SPAN_XBLOCK_BYTES
                                                  : XBLOCK_BYTES;
    int64_t tb = bytes / (cp * (int64_t)sizeof(double));
    if (tb < K3_PT) tb = K3_PT; /* one lane-pass tile of tokens at least (k3avx2_matmul512.c) */
    tb -= tb % K3_PT;           /* and whole tiles */
    return tb < T ? tb : T;
}

/* ---- one 32-column chunk of products added to the lanes ------------------------------ */
static inline void chunk_bf16(k3_lanes *L, const uint16_t *w, const double *x) {
    const __m128i z = _mm_setzero_si128();
    for (int q = 0; q < 4; ++q) {
        __m128i v = _mm_loadu_si128((const __m128i *)(w + 8 * q));
        __m256d lo = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(z, v)));
        __m256d hi = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpackhi_epi16(z, v)));
        L->a[2 * q] = _mm256_fmadd_pd(_mm256_loadu_pd(x + 8 * q), lo, L->a[2 * q]);
        L->a[2 * q + 1] = _mm256_fmadd_pd(_mm256_loadu_pd(x + 8 * q + 4), hi, L->a[2 * q + 1]);
    }
}

static inline void chunk_f32(k3_lanes *L, const float *w, const double *x) {
    for (int k = 0; k < 8; ++k) {
        __m256d wv = _mm256_cvtps_pd(_mm_loadu_ps(w + 4 * k));
        L->a[k] = _mm256_fmadd_pd(_mm256_loadu_pd(x + 4 * k), wv, L->a[k]);
    }
}

/* ---- T == 1 row kernels --------------------------------------------------------------- */
/* The lanes travel in registers through a row. A row with a column tail (cols % 32 != 0:
 * none of the model's matrices, some small ones in tests) takes its own function, the one
 * place that copies (memcpy, a call): kept in the same function, the call made the compiler
 * keep every row's lanes in memory, cleared by a `rep stos` at the row's start and stored and
 * reloaded for the fold (measured on a Zen 3 core: 14 % of an MXFP4 row's time). */
static __attribute__((noinline)) double row_tailed(enum k3_wkind kind, const void *w,
                                                  int64_t cols, const double *x) {
    const size_t es = kind == K3_W_BF16 ? sizeof(uint16_t) : sizeof(float);
    const uint8_t *wb = (const uint8_t *)w;
    k3_lanes L;
    k3_lanes_zero(&L);
    int64_t c = 0;
    uint8_t tail[32 * sizeof(float)] __attribute__((aligned(32))) = {0};
    for (;; c += 32) {
        const void *chunk = wb + es * (size_t)c;
        if (c + 32 > cols) { /* the tail, completed with +0.0 weights */
            memcpy(tail, chunk, es * (size_t)(cols - c));
            chunk = tail;
        }
        if (kind == K3_W_BF16)
            chunk_bf16(&L, (const uint16_t *)chunk, x + c);
        else
            chunk_f32(&L, (const float *)chunk, x + c);
        if (c + 32 >= cols) break;
    }
    return k3_lanes_fold(&L);
}

/* An MXFP4 row decoded one weight at a time (the tables are not exact). */
static __attribute__((noinline)) double row_mxfp4_scalar(const uint8_t *pk, const uint8_t *sc,
                                                         int64_t groups, const double *xp) {
    k3_lanes L;
    k3_lanes_zero(&L);
    __m256d q[8];
    double tmp[32];
    for (int64_t g = 0; g < groups; ++g) {
        decode_group_scalar(tmp, pk + 16 * g, sc[g]);
        for (int k = 0; k < 8; ++k) q[k] = _mm256_loadu_pd(tmp + 4 * k);
        add_group(&L, q, xp + 32 * g);
    }
    return fold_mx(&L);
}

static inline float row_bf16(const uint16_t *w, int64_t cols, const double *x) {
    if (cols & 31) return (float)row_tailed(K3_W_BF16, w, cols, x);
    k3_lanes L;
    k3_lanes_zero(&L);
    for (int64_t c = 0; c < cols; c += 32) {
        PREFETCH_L2(w + c); /* one 64-byte line per chunk */
        chunk_bf16(&L, w + c, x + c);
    }
    return (float)k3_lanes_fold(&L);
}

static inline float row_f32(const float *w, int64_t cols, const double *x) {
    if (cols & 31) return (float)row_tailed(K3_W_F32, w, cols, x);
    k3_lanes L;
    k3_lanes_zero(&L);
    for (int64_t c = 0; c < cols; c += 32) {
        PREFETCH_L2(w + c); /* two 64-byte lines per chunk */
        PREFETCH_L2(w + c + 16);
        chunk_f32(&L, w + c, x + c);
    }
    return (float)k3_lanes_fold(&L);
}

static inline float row_mxfp4(const uint8_t *pk, const uint8_t *sc, int64_t groups,
                              const double *xp) {
    if (!g_tables_exact) return (float)row_mxfp4_scalar(pk, sc, groups, xp);
    k3_lanes L;
    k3_lanes_zero(&L);
    __m256d q[8];
    for (int64_t g = 0; g < groups; ++g) {
        if ((g & 3) == 0) PREFETCH_L2(pk + 16 * g); /* one line per 4 groups */
        if ((g & 63) == 0) PREFETCH_L2(sc + g);     /* and one line of scale bytes per 64 */
        decode_group(q, pk + 16 * g, sc[g]);
        add_group(&L, q, xp + 32 * g);
    }
    return (float)fold_mx(&L);
}

/* ---- drivers ---------------------------------------------------------------------------- */

static inline float row_dot(enum k3_wkind kind, const void *w, const uint8_t *scales, int64_t o,
                            int64_t cols, const double *x) {
    if (kind == K3_W_BF16) return row_bf16((const uint16_t *)w + o * cols, cols, x);
    if (kind == K3_W_F32) return row_f32((const float *)w + o * cols, cols, x);
    return row_mxfp4((const uint8_t *)w + o * (cols / 2), scales + o * (cols / 32), cols / 32, x);
}

/* The AVX2 MXFP4 tiles of two to nine tokens (k3avx2_matmul256.c, included after this file). */
static void k3__row256_mxfp4(const void *w, const uint8_t *sc, int64_t o, int64_t nr, int64_t rows,
                             int64_t cols, int64_t cp, const double *xd, int64_t nt, float *y);

/* Rows o .. o + nr - 1 (tile_rows' count) of one matrix for the nt tokens of a widened block
 * (xd: nt x cp; y: the block's first token, y[t * rows + o]); `ahead` rows after them are the
 * same job's next, in the same matrix (the one-token tiles prefetch them). */
static inline void do_rows(enum k3_wkind kind, int blocked, const void *w, const uint8_t *sc,
                           int64_t o, int64_t nr, int64_t rows, int64_t cols, int64_t cp,
                           const double *xd, int64_t nt, float *y, int64_t ahead) {
    /* the tile kernels, one per path and weight kind (each inner loop specialised) */
    typedef void (*rows_fn)(const void *, const uint8_t *, int64_t, int64_t, int64_t, int64_t,
                            int64_t, const double *, int64_t, float *);
    static const rows_fn tiles[2][3] = {
        {k3__row512_bf16, k3__row512_f32, k3__row512_mxfp4},
        {NULL, NULL, k3__row256_mxfp4}, /* bf16 and float32 take the AVX2 span tiles */
    };
    static const rows_fn spans[2][3] = {
        {k3__span512_bf16, k3__span512_f32, k3__span512_mxfp4},
        {k3__span256_bf16, k3__span256_f32, k3__span256_mxfp4},
    };
    typedef void (*one_fn)(const void *, const uint8_t *, int64_t, int64_t, int64_t, int64_t,
                           const double *, float *, int64_t);
    static const one_fn ones[3] = {k3__one512_bf16, k3__one512_f32, k3__one512_mxfp4};
    if (blocked == K3_PATH_ONE) {
        ones[kind](w, sc, o, nr, cols, cp, xd, y, ahead);
        return;
    }
    if (blocked == K3_PATH_512 || blocked == K3_PATH_256) {
        tiles[blocked - K3_PATH_512][kind](w, sc, o, nr, rows, cols, cp, xd, nt, y);
        return;
    }
    if (blocked == K3_PATH_SPAN || blocked == K3_PATH_SPAN256) {
        spans[blocked == K3_PATH_SPAN256][kind](w, sc, o, nr, rows, cols, cp, xd, nt, y);
        return;
    }
    for (int64_t r = o; r < o + nr; ++r)
        for (int64_t t = 0; t < nt; ++t) y[t * rows + r] = row_dot(kind, w, sc, r, cols, xd + t * cp);
}

/* ---- the MXFP4 decode ceiling (a machine ceiling, like k3_fma_peak) ---------------------
 * A routed expert of a decode step has one row of activations, and its product is bound by
 * turning packed weights into float64 lanes, not by the multiply-adds: on Zen 4 each
 * table permute (eight weights) takes a slot of the pipes the FMAs run on. So the compute
 * floor of a batched step counts every MXFP4 weight it decodes at this rate and only the
 * further tokens' multiply-adds at the FMA peak. Each member multiplies a block of
 * DEC_ROWS x DEC_COLS MXFP4 weights (8 KiB packed, 8 KiB of activations: L1-resident) by
 * one token with the backend's own one-token path (do_rows, as k3_matmul_mxfp4 would),
 * `iters` times a pass; k3_decode_peak returns the best seconds per pass and the weights a
 * member multiplies in one (`*weights`: iters x DEC_ROWS x DEC_COLS). */
#define DEC_ROWS 16
#define DEC_COLS 1024

static void decode_member(k3_team *t, int idx) {
    uint8_t packed[DEC_ROWS * DEC_COLS / 2] __attribute__((aligned(64)));
    uint8_t scales[DEC_ROWS * DEC_COLS / 32] __attribute__((aligned(64)));
    double xd[DEC_COLS] __attribute__((aligned(64)));
    float y[DEC_ROWS];
    for (int i = 0; i < DEC_ROWS * DEC_COLS / 2; ++i) packed[i] = (uint8_t)(i * 37 + idx);
    for (int i = 0; i < DEC_ROWS * DEC_COLS / 32; ++i) scales[i] = (uint8_t)(120 + i % 8);
    for (int i = 0; i < DEC_COLS; ++i) xd[i] = 1.0 / (double)(i + 1);
    const int path = use_blocked(K3_W_MXFP4, 1);
    for (int rep = 0; rep < t->repeat; ++rep) {
        pthread_barrier_wait(&t->bar);
        const double t0 = now_s();
        for (int64_t k = 0; k < t->iters; ++k) {
            do_rows(K3_W_MXFP4, path, packed, scales, 0, DEC_ROWS, DEC_ROWS, DEC_COLS, DEC_COLS,
                    xd, 1, y, 0);
            t->fsum[idx] += (double)y[k % DEC_ROWS];
        }
        pthread_barrier_wait(&t->bar);
        if (idx == 0) {
            const double dt = now_s() - t0;
            if (dt < t->best) t->best = dt;
        }
    }
}

double k3_decode_peak(int64_t iters, int repeat, int64_t *weights, double *sink) {
    if (weights) *weights = iters * DEC_ROWS * DEC_COLS;
    return team_peak(decode_member, iters, repeat, sink);
}
#undef DEC_ROWS
#undef DEC_COLS

/* One matrix of a group that shares its input: y[t * rows + o]. */
typedef struct {
    const void *w;
    const uint8_t *sc;
    int64_t rows;
    float *y;
} k3_mat;

/* The rows a path takes at once from a range with `left` rows, `in_mat` of them in the
 * current matrix: one on the rows path, a one-token tile of ONE_TILE or a lane-pass tile of
 * K3_PR where the range has them, all of them on the span path. */
static inline int64_t tile_rows(int path, int64_t left, int64_t in_mat) {
    int64_t nr = path == K3_PATH_ROWS  ? 1
                 : path == K3_PATH_SPAN || path == K3_PATH_SPAN256 ? left
                 : path == K3_PATH_ONE  ? ONE_TILE
                                        : K3_PR;
    if (nr > left) nr = left;
    return nr < in_mat ? nr : in_mat;
}

/* The rows of the same job and matrix after a tile of nr (do_rows' `ahead`). */
static inline int64_t rows_ahead(int64_t left, int64_t in_mat, int64_t nr) {
    return (left < in_mat ? left : in_mat) - nr;
}

/* The pool's chunk of rows for a job of `total` rows on `path` over cp padded columns and
 * about nt tokens a row. A claim that is only microseconds of work on rows from memory
 * starts cold, and the prefetch at its end runs into rows the other thread has claimed, so
 * a claim is sized by its work, within ROWS_CLAIMS claims per thread at least:
 *  - the AVX2 one-token rows and two-token tiles: ROWS_CLAIMS claims per thread, at least
 *    ROW_CHUNK rows each. The medium model's resident decode, two Zen 2 threads, three
 *    alternating runs of 64 tokens, s/token: claims of 16 rows 0.1087-0.1095, 64 rows
 *    0.0984-0.0991, 256 rows 0.0957-0.0974, four claims per thread 0.0958-0.0965;
 *  - the AVX2 span tiles: whole spans, as many as make SPAN2_CLAIM_MACS multiply-adds. The
 *    64 routed experts of a medium MoE layer in prefill (a span of an expert's 16-odd tokens
 *    is about 0.18 M), two Zen 2 threads, three alternating rounds, ms for 1 / 2 / 4 / 8 /
 *    16 spans a claim: 59.0-59.4 / 57.8-58.2 / 56.5-57.0 / 55.3-56.4 / 55.2-55.4; a span
 *    of the trunk's [. x 1536] products at 128 tokens (2.9 M) is a claim alone, and larger
 *    claims of those measured the same. The AVX-512 span tiles take the same rule in spans
 *    of SPAN_ROWS (they had taken 16 rows, one span, a claim): on two Zen 4 threads the
 *    same 64 experts measured the same either way (44.4-44.6 ms against 44.6-44.7);
 *  - the AVX-512 one-token tiles: ROWS_CLAIMS claims per thread in whole tiles of ONE_TILE
 *    rows, at least ONE_CHUNK_TILES tiles on rows wider than ONE_WIDE (they had taken one
 *    tile a claim on the narrower rows). The medium model's resident decode, two Zen 4
 *    threads, eight alternating runs of 2 x 64 tokens: median 0.1047 -> 0.0978 s/token
 *    (best 0.0931 -> 0.0791). */
static inline int64_t row_chunk(int path, int64_t cp, int64_t total, int64_t nt) {
    if (k3__forced()) return K3_PR;
    const int64_t most = total / ((int64_t)k3__threads() * ROWS_CLAIMS); /* rows a claim */
    if (path == K3_PATH_SPAN256 || path == K3_PATH_SPAN) {
        const int64_t rows = path == K3_PATH_SPAN ? SPAN_ROWS : SPAN2_ROWS; /* a span */
        const int64_t span = rows * cp * (nt > 1 ? nt : 1);
        int64_t spans = (SPAN2_CLAIM_MACS + span - 1) / span;
        if (spans > most / rows) spans = most / rows;
        return (spans > 1 ? spans : 1) * rows;
    }
    if (path == K3_PATH_ROWS || path == K3_PATH_256) return most > ROW_CHUNK ? most : ROW_CHUNK;
    if (path == K3_PATH_ONE) {
        const int64_t least = cp > ONE_WIDE ? ONE_CHUNK_TILES : 1, tiles = most / ONE_TILE;
        return (tiles > least ? tiles : least) * ONE_TILE;
    }
    return ROW_CHUNK;
}

/* Rows [b, e) of the concatenated rows of a group of matrices, for one token block. */
typedef struct {
    enum k3_wkind kind;
    int blocked;
    const k3_mat *m;
    int n;
    int64_t cols, cp, t0, nt;
    const double *xd;
} rows_job;

static void rows_job_fn(void *ctx, int64_t b, int64_t e) {
    const rows_job *j = (const rows_job *)ctx;
    int i = 0;
    int64_t o = b;
    while (o >= j->m[i].rows) o -= j->m[i++].rows;
    for (int64_t g = b; g < e;) {
        while (o >= j->m[i].rows) o -= j->m[i++].rows;
        const int64_t nr = tile_rows(j->blocked, e - g, j->m[i].rows - o);
        do_rows(j->kind, j->blocked, j->m[i].w, j->m[i].sc, o, nr, j->m[i].rows, j->cols, j->cp,
                j->xd, j->nt, j->m[i].y + j->t0 * j->m[i].rows,
                rows_ahead(e - g, j->m[i].rows - o, nr));
        g += nr;
        o += nr;
    }
}

/* Every row of every matrix of `m` for one token block: on the pool when `par`. */
static void group_rows(enum k3_wkind kind, int blocked, const k3_mat *m, int n, int64_t cols,
                       int64_t cp, const double *xd, int64_t t0, int64_t nt, int par) {
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += m[i].rows;
    rows_job j = {kind, blocked, m, n, cols, cp, t0, nt, xd};
    if (par)
        k3__pool_run(rows_job_fn, &j, total, row_chunk(blocked, cp, total, nt), k3__threads());
    else
        rows_job_fn(&j, 0, total);
}

/* Several matrices over the same x in one call: x widened once per token block, the rows of
 * every matrix handed out together on the pool (k3avx2_pool.c).
 * Tokens in blocks whose float64 activations stay in L2; within a block each row is read
 * from memory once and from cache for the block's other tokens. Rows go out in chunks as
 * threads free up: on a busy machine a thread that loses its core does not hold the others
 * back (the bits never depend on which thread ran a row). */
static int matmul_group(enum k3_wkind kind, const k3_mat *m, int n, int64_t cols,
                        const float *x, int64_t T) {
    const int64_t cp = ROUND32(cols);
    const int64_t tb = token_block(kind, T, cp);
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += m[i].rows;
    double *xd = (double *)k3__alloc((size_t)(tb * cp) * sizeof(double));
    if (!xd) return K3_ENOMEM;
    const int par = K3_BIG(total * cols * T, K3_PAR_MATMUL);
    for (int64_t t0 = 0; t0 < T; t0 += tb) {
        const int64_t nt = t0 + tb < T ? tb : T - t0;
        const int blocked = use_blocked(kind, nt);
        widen_par(xd, x + t0 * cols, nt, cols, cp, x_order(kind, blocked), par);
        group_rows(kind, blocked, m, n, cols, cp, xd, t0, nt, par);
    }
    k3__free(xd);
    return 0;
}

static int matmul(enum k3_wkind kind, const void *w, const uint8_t *scales, int64_t rows,
                  int64_t cols, const float *x, int64_t T, float *y) {
    k3_mat m = {w, scales, rows, y};
    return matmul_group(kind, &m, 1, cols, x, T);
}

int k3_matmul_bf16(const uint16_t *w, int64_t rows, int64_t cols, const float *x, int64_t T,
                   float *y) {
    return matmul(K3_W_BF16, w, NULL, rows, cols, x, T, y);
}

int k3_matmul_f32(const float *w, int64_t rows, int64_t cols, const float *x, int64_t T,
                  float *y) {
    return matmul(K3_W_F32, w, NULL, rows, cols, x, T, y);
}

int k3_matmul_mxfp4(const uint8_t *packed, const uint8_t *scales, int64_t rows, int64_t cols,
                    const float *x, int64_t T, float *y) {
    if (cols % K3C_MXFP4_GROUP) return K3_EINVAL;
    return matmul(K3_W_MXFP4, packed, scales, rows, cols, x, T, y);
}

int k3_matmul_many(int kind, int n, void **w, uint8_t **scales, const int64_t *rows, int64_t cols,
                   const float *x, int64_t T, float **y) {
    if (n < 1 || n > 16 || kind < K3_W_BF16 || kind > K3_W_MXFP4) return K3_EINVAL;
    if (kind == K3_W_MXFP4 && cols % K3C_MXFP4_GROUP) return K3_EINVAL;
    k3_mat m[16];
    for (int i = 0; i < n; ++i) {
        m[i].w = w[i];
        m[i].sc = scales ? scales[i] : NULL;
        m[i].rows = rows[i];
        m[i].y = y[i];
    }
    return matmul_group((enum k3_wkind)kind, m, n, cols, x, T);
}

typedef struct {
    const float *h1, *h3;
    float *a;
    double b1, b2;
} situ_job;

/* Elements a claim of the SiTU stage (1 when the thresholds are forced). Claims of 64 had
 * the two threads contend for the claim word: the 64 experts of a medium MoE layer in
 * prefill (688,128 SiTU elements), two Zen 2 threads, three alternating rounds: 60.6 ->
 * 59.3 ms with 512. */
#define SITU_CHUNK 512

static void situ_job_fn(void *ctx, int64_t b, int64_t e) {
    const situ_job *j = (const situ_job *)ctx;
    k3__situ(j->h1 + b, j->h3 + b, e - b, j->b1, j->b2, j->a + b);
}

/* ---- the SiTU MLP in one call -----------------------------------------------------------
 * y = W2 . situ_glu(W1 . x, W3 . x, b1, b2): the same three products and the same
 * elementwise SiTU as separate calls (the same bits), in one call: the W1 and W3 rows
 * together, then SiTU, then the W2 rows, per token block, each stage on the pool. */
int k3_situ_mlp(int kind, const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3,
                const void *w2, const uint8_t *s2, int64_t inter, int64_t cols, int64_t out_rows,
                const float *x, int64_t T, double b1, double b2, float *y) {
    if (kind < K3_W_BF16 || kind > K3_W_MXFP4) return K3_EINVAL;
    if (kind == K3_W_MXFP4 && (cols % K3C_MXFP4_GROUP || inter % K3C_MXFP4_GROUP)) return K3_EINVAL;
    const enum k3_wkind kd = (enum k3_wkind)kind;
    const int64_t cp = ROUND32(cols), ip = ROUND32(inter);
    int64_t tb = token_block(kd, T, cp > ip ? cp : ip);
    double *xd = (double *)k3__alloc((size_t)(tb * cp) * sizeof(double));
    double *ad = (double *)k3__alloc((size_t)(tb * ip) * sizeof(double));
    float *h = (float *)k3__alloc((size_t)(3 * tb * inter) * sizeof(float));
    if (!xd || !ad || !h) {
        k3__free(xd);
        k3__free(ad);
        k3__free(h);
        return K3_ENOMEM;
    }
    float *h1 = h, *h3 = h + tb * inter, *a = h + 2 * tb * inter;
    const int par = K3_BIG((2 * inter * cols + out_rows * inter) * T, K3_PAR_MATMUL);
    const k3_mat up[2] = {{w1, s1, inter, h1}, {w3, s3, inter, h3}}; /* block-local */
    const k3_mat down = {w2, s2, out_rows, y};
    for (int64_t t0 = 0; t0 < T; t0 += tb) {
        const int64_t nt = t0 + tb < T ? tb : T - t0;
        const int blocked = use_blocked(kd, nt);
        widen_par(xd, x + t0 * cols, nt, cols, cp, x_order(kd, blocked), par);
        group_rows(kd, blocked, up, 2, cols, cp, xd, 0, nt, par);
        situ_job sj = {h1, h3, a, b1, b2};
        if (par)
            k3__pool_run(situ_job_fn, &sj, nt * inter, k3__forced() ? 1 : SITU_CHUNK,
                         k3__threads());
        else
            situ_job_fn(&sj, 0, nt * inter);
        widen_par(ad, a, nt, inter, ip, x_order(kd, blocked), par);
        group_rows(kd, blocked, &down, 1, inter, ip, ad, t0, nt, par);
    }
    k3__free(xd);
    k3__free(ad);
    k3__free(h);
    return 0;
}
