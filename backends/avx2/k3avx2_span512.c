/* k3avx2_span512.c - the AVX-512 multi-token products over spans of rows, their activations
 * in pass-major order (k3avx2_matmul.c's K3_PATH_SPAN; k3avx2_matmul512.c has the tiles it
 * replaces from SPAN_MIN_TOKENS on).
 *
 * Pass-major order. Lane register k (k = 0..3) of a (row, token) sum only ever receives the
 * columns 32c + 8k .. 32c + 8k + 7, in increasing c (the lane-pass tiles of
 * k3avx2_matmul512.c). Here the activations are widened with those columns side by side:
 * column 32c + 8k + i of a token's cp columns sits at k * (cp / 4) + 8c + i, so quarter k of
 * the row is everything lane register k adds, contiguous, and the rows' float64 copies are
 * laid out the same way. A (row, token) sum is then four plain eight-lane dot products of
 * cp / 4 columns, one per quarter, each adding its terms in increasing column order from
 * +0.0, and the fold is fold512's: the bits are the one-token kernels', token by token.
 *
 * Why spans. The lane-pass tiles take four rows at a time, and for every four rows they
 * stream each token tile's activations from L2 again, and they widen every weight again for
 * each five tokens. Here a job's rows go in spans of SPAN_ROWS: the span's rows are decoded
 * once into a float64 copy (dec_chunk: the same weights, exact for every MXFP4 scale byte),
 * and then, for each tile of SPAN_T tokens and each block of SPAN_QB columns of a quarter,
 * the tile's activations (six tokens, 24 KiB) are loaded into L1 once and multiplied by
 * every four-row tile of the span in turn. A tile keeps 24 accumulators, the six tokens'
 * activation vectors and one weight vector in 31 of the 32 zmm registers, and its inner
 * loop is loads and FMAs only. Measured on an Emerald Rapids core (standalone loop, one
 * thread, 48 tokens x 1536 columns): 4 x 6 tiles streaming their activations from L2 row
 * tile after row tile, 19-22 GMAC/s; spans over a float32 copy, 23-26; spans over a float64
 * copy, 29-30 (the FMA peak is 41). In the 128-id prefill of the medium model the bf16
 * products went from 33 to 40-45 GMAC/s on two threads.
 *
 * On AMD cores the span's copy is float32 (k3_use_span_f32 below): the same weights, widened
 * as the tiles load them. A tile's sums are folded four rows at a time (fold512_4), the
 * four results stored together; the same additions as fold512's.
 *
 * bf16 rows of whole 32-column chunks are not copied on AMD cores: the tiles read each
 * eight-weight step where it is (16 bytes of a row's 64-byte chunk) and widen it as the
 * lane-pass tiles do, the same float64 weights as the copy's, and the first token tile's
 * first pass fetches the next span's rows. Widening there costs the tiles nothing on Zen 4
 * (a 4 x 4 tile in L1 ran 27.1 GMAC/s from bf16, 27.2 from float32, the FMA peak 28.7),
 * while the copy had been a fifth of an eight-token product's samples. One Zen 4 thread,
 * medians of five alternating runs, GMAC/s copy -> in place: [1536 x 1536] x 8 in cache
 * 18.5 -> 22.8, [1536 x 7232] x 8 from memory 18.6 -> 19.5; two threads from memory,
 * [1536 x 1536] x 16 41.3 -> 42.3, [14464 x 1536] x 8 37.1 -> 39.1, [1536 x 7232] x 8 36.3
 * -> 34.6 (noisy).
 */
#include "k3avx2_internal.h"

#define SPAN_ROWS 16 /* rows per span (a multiple of K3_PR) */
#define SPAN_T 6     /* tokens per tile */
#define SPAN_QB 512  /* columns of a quarter per block: six tokens' float64 activations, 24 KiB */
/* The span tiles from this many tokens on; below it the lane-pass tiles of k3avx2_matmul512.c
 * are faster (a span's copy is decoded for too few tokens). Measured on an Emerald Rapids
 * core, one thread, bf16 [1536 x 1536]: 2 tokens 5.3 GMAC/s against 11.0, 4 tokens 9.2
 * against 10.9, 6 tokens 12.4 against 13.2, 53 tokens 21-25 against 18-21; for MXFP4 the
 * float32-copy tiles measured on Zen 4 gave the same crossing (2 tokens 10.0 against 13.5,
 * 6 tokens 15.4 against 16.0, 10 tokens 17.1 against 16.2). */
#define SPAN_MIN_TOKENS 8
/* The span tiles' token blocks (k3avx2_matmul.c's token_block). A span's copy stays in L2
 * while every tile of the block's tokens passes over it, and a tile's activations are read
 * once per span, so a block need not fit L2: blocks of L2 size (640 KiB) cut a 128-id
 * prefill of the medium model into three ([. x 1536]: 53 + 53 + 22 tokens) or nine
 * ([. x 7232]) blocks, each decoding every span's copy again. One Zen 4 core, bf16 x 128
 * tokens, best of 30 interleaved, GMAC/s for 640 KiB / 4 MiB blocks: [1536 x 7232] 17.8 /
 * 24.4; two threads: [1536 x 1536] 44.0 / 45.7, [7232 x 1536] 46.4 / 50.4, [1536 x 7232]
 * 36.3 / 48.9, [1536 x 4096] 42.0 / 50.1 (8 MiB blocks no better than 4 MiB). */
#define SPAN_XBLOCK_BYTES (4 << 20)

/* Whether a span's copy is float32, each weight widened as the tiles load it, rather than
 * float64 (k3_use_span_f32). Both are the same weights, so the bits are the same. On Zen 4
 * the widening goes to other ports than the FMAs and costs the tiles nothing, while the copy
 * takes half the stores and the L2 traffic: the routed experts of three MoE layers of the
 * medium model's 128-id prefill (six grouped calls, two threads, best of 30 interleaved)
 * took 128.6 ms against 135.7. On Intel cores the widening shares a
 * port with the 512-bit FMAs (an Emerald Rapids core ran the tiles at 23-26 GMAC/s over a
 * float32 copy, 29-30 over a float64 one), so the float32 copy is the AMD default only. */
static int g_span_f32 = 0;

__attribute__((constructor)) static void k3__pick_span_f32(void) {
    __builtin_cpu_init();
    g_span_f32 = __builtin_cpu_is("amd");
}

/* Read the span tiles' weights from float32 copies when `on` is 1, float64 copies when 0,
 * and leave the choice as it is when `on` is negative; returns whether float32 copies are
 * used now (a switch for the tests and the benchmark). */
int k3_use_span_f32(int on) {
    if (on >= 0) g_span_f32 = on ? 1 : 0;
    return g_span_f32;
}

/* Where column i of a row of cp columns goes in pass-major order. */
static inline int64_t span_index(int64_t i, int64_t cp) {
    return ((i & 31) >> 3) * (cp / 4) + ((i >> 5) << 3) + (i & 7);
}

/* Chunk c of row o as float32 in natural column order, columns 0-15 in lo and 16-31 in hi
 * (+0.0 past `cols`); the weights dec_chunk gives, each a float32 exactly (bf16 and float32
 * always, MXFP4 for scale bytes up to MX_F32_MAX_SCALE: span_f32_exact). An MXFP4
 * group's 16 bytes widen to 16 dwords; their low nibbles are the even columns and their
 * high nibbles the odd ones, each a permute of the scale byte's table, and two unpacks and
 * two permutes put the 32 columns back in order. */
K3_INLINE512 void dec_chunk32(enum k3_wkind kind, __m512 *lo, __m512 *hi, const void *w,
                              const uint8_t *sc, int64_t o, int64_t cols, int64_t c) {
    if (kind == K3_W_MXFP4) {
        const __m512i i01 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i i23 =
            _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        const __m512i by = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)((const uint8_t *)w + o * (cols / 2) + 16 * c)));
        const __m512 t = _mm512_load_ps(WF512[sc[o * (cols / 32) + c]]);
        const __m512 ev = _mm512_permutexvar_ps(by, t);
        const __m512 od = _mm512_permutexvar_ps(_mm512_srli_epi32(by, 4), t);
        /* per 128-bit lane l: columns 8l .. 8l + 3, and 8l + 4 .. 8l + 7 */
        const __m512 l4 = _mm512_unpacklo_ps(ev, od), h4 = _mm512_unpackhi_ps(ev, od);
        *lo = _mm512_permutex2var_ps(l4, i01, h4);
        *hi = _mm512_permutex2var_ps(l4, i23, h4);
        return;
    }
    const int64_t left = cols - 32 * c;
    if (kind == K3_W_BF16) {
        const uint16_t *r = (const uint16_t *)w + o * cols + 32 * c;
        __m512i v;
        if (left >= 32) {
            v = _mm512_loadu_si512((const void *)r);
        } else {
            uint16_t tail[32] = {0};
            memcpy(tail, r, (size_t)left * sizeof(uint16_t));
            v = _mm512_loadu_si512((const void *)tail);
        }
        *lo = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
        *hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
        return;
    }
    const float *r = (const float *)w + o * cols + 32 * c;
    if (left >= 32) {
        *lo = _mm512_loadu_ps(r);
        *hi = _mm512_loadu_ps(r + 16);
    } else {
        float tail[32] = {0};
        memcpy(tail, r, (size_t)left * sizeof(float));
        *lo = _mm512_loadu_ps(tail);
        *hi = _mm512_loadu_ps(tail + 16);
    }
}

/* Whether every weight of rows o .. o + n - 1 is a float32 exactly: always for bf16 and
 * float32, for MXFP4 when no scale byte of the rows is past MX_F32_MAX_SCALE. */
K3_INLINE512 int span_f32_exact(enum k3_wkind kind, const uint8_t *sc, int64_t o, int64_t n,
                                int64_t cols) {
    if (kind != K3_W_MXFP4) return 1;
    const uint8_t *s0 = sc + o * (cols / 32);
    int past = 0;
    for (int64_t i = 0; i < n * (cols / 32); ++i) past |= s0[i] > MX_F32_MAX_SCALE;
    return !past;
}

/* Rows o .. o + n - 1 of a matrix as pass-major rows of cp weights (+0.0 from column `cols`
 * on) in wb, and rows n .. n4 - 1 all +0.0: float64 (each 32-column chunk decoded by
 * dec_chunk, the weights the lane-pass tiles multiply, exact for every MXFP4 scale byte),
 * or where f32 the same weights as float32 (dec_chunk32; the caller checks span_f32_exact). */
K3_INLINE512 void span_copy(enum k3_wkind kind, const int f32, const void *w, const uint8_t *sc,
                            int64_t o, int64_t n, int64_t n4, int64_t cols, int64_t cp,
                            void *wb) {
    const int64_t q = cp / 4;
    const size_t es = f32 ? sizeof(float) : sizeof(double);
    for (int64_t r = 0; r < n4; ++r) {
        if (r >= n) {
            memset((char *)wb + (size_t)(r * cp) * es, 0, (size_t)cp * es);
            continue;
        }
        for (int64_t c = 0; 32 * c < cp; ++c) {
            prefetch_chunk(kind, w, sc, o + r, cols, c);
            if (f32) {
                float *out = (float *)wb + r * cp + 8 * c;
                __m512 lo, hi;
                dec_chunk32(kind, &lo, &hi, w, sc, o + r, cols, c);
                _mm256_storeu_ps(out, _mm512_castps512_ps256(lo));
                _mm256_storeu_ps(out + q, _mm512_extractf32x8_ps(lo, 1));
                _mm256_storeu_ps(out + 2 * q, _mm512_castps512_ps256(hi));
                _mm256_storeu_ps(out + 3 * q, _mm512_extractf32x8_ps(hi, 1));
            } else {
                double *out = (double *)wb + r * cp + 8 * c;
                __m512d v[4];
                dec_chunk(kind, v, w, sc, o + r, cols, c);
                for (int k = 0; k < 4; ++k) _mm512_storeu_pd(out + k * q, v[k]);
            }
        }
    }
}

/* Eight weights of a span's copy from element i on: float64, or float32 widened (exact). */
K3_INLINE512 __m512d span_w(const int f32, const void *wb, int64_t i) {
    return f32 ? _mm512_cvtps_pd(_mm256_loadu_ps((const float *)wb + i))
               : _mm512_loadu_pd((const double *)wb + i);
}

/* n8 eight-column steps of one quarter block: four rows of the copy (from element w0 of wb,
 * cp elements apart; float32 where f32) against NT tokens (x, cp doubles apart), added to
 * acc. */
K3_INLINE512 void span_block(const int NT, const int f32, __m512d acc[K3_PR][SPAN_T],
                             const void *wb, int64_t w0, int64_t cp, const double *x, int64_t n8) {
    for (int64_t s = 0; s < n8; ++s) {
        __m512d xv[SPAN_T];
        for (int j = 0; j < NT; ++j) xv[j] = _mm512_loadu_pd(x + j * cp + 8 * s);
        for (int r = 0; r < K3_PR; ++r) {
            const __m512d q = span_w(f32, wb, w0 + r * cp + 8 * s);
            for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_fmadd_pd(q, xv[j], acc[r][j]);
        }
    }
}

/* span_block over bf16 rows read where they are (rp[r]: row r's first weight, natural
 * order): step s of quarter k from chunk c0 on is the eight weights at 32 (c0 + s) + 8k,
 * widened as the lane-pass tiles widen them (the same float64 values as a copy's). */
K3_INLINE512 void span_block_bf16(const int NT, __m512d acc[K3_PR][SPAN_T],
                                  const uint16_t *const rp[K3_PR], int64_t c0, const int k,
                                  int64_t cp, const double *x, int64_t n8, int64_t pf) {
    for (int64_t s = 0; s < n8; ++s) {
        __m512d xv[SPAN_T];
        for (int j = 0; j < NT; ++j) xv[j] = _mm512_loadu_pd(x + j * cp + 8 * s);
        for (int r = 0; r < K3_PR; ++r) {
            if (pf) _mm_prefetch((const char *)(rp[r] + 32 * (c0 + s) + pf), _MM_HINT_T1);
            const __m128i v = _mm_loadu_si128((const __m128i *)(rp[r] + 32 * (c0 + s) + 8 * k));
            const __m512d q = _mm512_cvtps_pd(
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
            for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_fmadd_pd(q, xv[j], acc[r][j]);
        }
    }
}

/* NT tokens (x: the first one's pass-major activations) against the nrt four-row tiles of a
 * span's copy wb (float32 where f32), or where src is not NULL of the span's n bf16 rows
 * read in place (src: its first row, rows `cols` apart; a tile's rows past n repeat row
 * n - 1, whose sums are never stored): part[rt][r][j][k] is lane register k of the (row
 * 4rt + r, token j) sum. */
K3_INLINE512 void span_tokens(const int NT, const int f32,
                              __m512d part[SPAN_ROWS / K3_PR][K3_PR][SPAN_T][4], const void *wb,
                              int64_t nrt, int64_t cp, const double *x, const uint16_t *src,
                              int64_t n, int64_t cols, int64_t pf) {
    const int64_t q = cp / 4;
    for (int k = 0; k < 4; ++k)
        for (int64_t b = 0; b < q; b += SPAN_QB) {
            const int64_t n8 = (q - b < SPAN_QB ? q - b : SPAN_QB) / 8;
            for (int64_t rt = 0; rt < nrt; ++rt) {
                __m512d acc[K3_PR][SPAN_T];
                for (int r = 0; r < K3_PR; ++r)
                    for (int j = 0; j < NT; ++j)
                        acc[r][j] = b ? part[rt][r][j][k] : _mm512_setzero_pd();
                if (src) {
                    const uint16_t *rp[K3_PR];
                    for (int r = 0; r < K3_PR; ++r) {
                        const int64_t i = rt * K3_PR + r;
                        rp[r] = src + (i < n ? i : n - 1) * cols;
                    }
                    span_block_bf16(NT, acc, rp, b / 8, k, cp, x + k * q + b, n8, k ? 0 : pf);
                } else {
                    span_block(NT, f32, acc, wb, rt * K3_PR * cp + k * q + b, cp, x + k * q + b, n8);
                }
                for (int r = 0; r < K3_PR; ++r)
                    for (int j = 0; j < NT; ++j) part[rt][r][j][k] = acc[r][j];
            }
        }
}

/* fold512 of four sums at once (sum r's lane registers a_r[0..3]), the four results in
 * order: the h = 16 and 8 steps on each sum's registers, then h = 4, 2 and 1 on the four
 * sums side by side (two sums a register, then four), every addition fold512's with the
 * same operands in the same order. For four sums the h = 4, 2 and 1 steps take 8 permutes,
 * 4 additions and one store, where four fold512 calls take 4 extracts, 4 vector and 12
 * scalar additions through memory and four scalar stores; the fold had been 9 % of
 * the routed experts' span tiles on Zen 4 (the calls of k3_use_span_f32's figure: 124.0 ms
 * against 125.4). */
K3_INLINE512 __m256d fold512_4(const __m512d *a0, const __m512d *a1, const __m512d *a2,
                               const __m512d *a3) {
    const __m512d *a[4] = {a0, a1, a2, a3};
    __m512d s[4];
    for (int r = 0; r < 4; ++r)
        s[r] = _mm512_add_pd(_mm512_add_pd(a[r][0], a[r][2]), _mm512_add_pd(a[r][1], a[r][3]));
    /* h = 4: lanes 0-3 += lanes 4-7, sums 0 | 1 and 2 | 3 in one register each */
    const __m512d t01 = _mm512_add_pd(_mm512_shuffle_f64x2(s[0], s[1], 0x44),
                                      _mm512_shuffle_f64x2(s[0], s[1], 0xEE));
    const __m512d t23 = _mm512_add_pd(_mm512_shuffle_f64x2(s[2], s[3], 0x44),
                                      _mm512_shuffle_f64x2(s[2], s[3], 0xEE));
    /* h = 2: lanes 0-1 += lanes 2-3 of each sum, the four sums' pairs in one register */
    const __m512i lo2 = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);
    const __m512i hi2 = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    const __m512d u = _mm512_add_pd(_mm512_permutex2var_pd(t01, lo2, t23),
                                    _mm512_permutex2var_pd(t01, hi2, t23));
    /* h = 1: lane 0 += lane 1 */
    const __m512d ev = _mm512_permutexvar_pd(_mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6), u);
    const __m512d od = _mm512_permutexvar_pd(_mm512_setr_epi64(1, 3, 5, 7, 1, 3, 5, 7), u);
    return _mm256_add_pd(_mm512_castpd512_pd256(ev), _mm512_castpd512_pd256(od));
}

/* Row o for nt tokens of pass-major xd, each weight widened on its own (a thread without
 * scratch for the span's copy). */
K3_INLINE512 void span_row_scalar(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                                  int64_t rows, int64_t cols, int64_t cp, const double *xd,
                                  int64_t nt, float *y) {
    const int64_t q = cp / 4;
    for (int64_t t = 0; t < nt; ++t) {
        __m512d a[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                        _mm512_setzero_pd()};
        const double *xt = xd + t * cp;
        for (int64_t c = 0; 32 * c < cp; ++c) {
            double v[32] __attribute__((aligned(64)));
            for (int64_t i = 0; i < 32; ++i) {
                const int64_t col = 32 * c + i;
                if (col >= cols) {
                    v[i] = 0.0;
                } else if (kind == K3_W_MXFP4) {
                    const int byte = ((const uint8_t *)w)[o * (cols / 2) + col / 2];
                    v[i] = WV512[sc[o * (cols / 32) + c]][(col & 1) ? byte >> 4 : byte & 15];
                } else if (kind == K3_W_BF16) {
                    const uint32_t u = (uint32_t)((const uint16_t *)w)[o * cols + col] << 16;
                    float f;
                    memcpy(&f, &u, 4);
                    v[i] = (double)f;
                } else {
                    v[i] = (double)((const float *)w)[o * cols + col];
                }
            }
            for (int k = 0; k < 4; ++k)
                a[k] = _mm512_fmadd_pd(_mm512_load_pd(v + 8 * k),
                                       _mm512_loadu_pd(xt + k * q + 8 * c), a[k]);
        }
        y[t * rows + o] = (float)fold512(a[0], a[1], a[2], a[3]);
    }
}

/* Rows o .. o + nr - 1 (any nr >= 1) for the nt tokens of a pass-major block (xd: nt x cp;
 * y[t * rows + r]), a span of SPAN_ROWS at a time. */
K3_INLINE512 void k3__span512(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                              int64_t nr, int64_t rows, int64_t cols, int64_t cp,
                              const double *xd, int64_t nt, float *y) {
    void *wb = k3__scratch((size_t)(SPAN_ROWS * cp) * sizeof(double));
    for (int64_t s0 = o; s0 < o + nr; s0 += SPAN_ROWS) {
        const int64_t n = o + nr - s0 < SPAN_ROWS ? o + nr - s0 : SPAN_ROWS;
        const int64_t nrt = (n + K3_PR - 1) / K3_PR;
        if (!wb) { /* no scratch for the copy */
            for (int64_t r = s0; r < s0 + n; ++r)
                span_row_scalar(kind, w, sc, r, rows, cols, cp, xd, nt, y);
            continue;
        }
        const int f32 = g_span_f32 && span_f32_exact(kind, sc, s0, n, cols);
        /* bf16 rows of whole chunks on AMD cores: read in place, no copy (see below) */
        const uint16_t *src = f32 && kind == K3_W_BF16 && cols == cp
                                  ? (const uint16_t *)w + s0 * cols : NULL;
        /* in place, the first token tile's first pass fetches the next span's rows (one line
         * of each per step) */
        const int64_t pf = src && s0 + SPAN_ROWS < o + nr ? SPAN_ROWS * cols : 0;
        if (!src && f32)
            span_copy(kind, 1, w, sc, s0, n, nrt * K3_PR, cols, cp, wb);
        else if (!src)
            span_copy(kind, 0, w, sc, s0, n, nrt * K3_PR, cols, cp, wb);
        /* ceil(nt / SPAN_T) tiles of nt / tiles tokens, the first nt % tiles one more: 16
         * tokens go 6 + 5 + 5, not 6 + 6 + 4, and 13 go 5 + 4 + 4, not 6 + 6 + 1 (a tile of
         * one or two tokens streams the span's copy for few multiply-adds). The same calls as
         * above: 137.3 ms against 141.2 */
        const int64_t tiles = (nt + SPAN_T - 1) / SPAN_T;
        for (int64_t i = 0, t0 = 0; i < tiles; ++i) {
            const int64_t m = nt / tiles + (i < nt % tiles);
            __m512d part[SPAN_ROWS / K3_PR][K3_PR][SPAN_T][4];
            const double *xt = xd + t0 * cp;
            const int64_t pfi = i ? 0 : pf; /* the first token tile fetches the next span */
            _Static_assert(SPAN_T == 6, "the token counts spelled out below");
#define K3_SPAN_M(F)                                                                       \
    switch (m) {                                                                           \
    case 1: span_tokens(1, F, part, wb, nrt, cp, xt, src, n, cols, pfi); break;            \
    case 2: span_tokens(2, F, part, wb, nrt, cp, xt, src, n, cols, pfi); break;            \
    case 3: span_tokens(3, F, part, wb, nrt, cp, xt, src, n, cols, pfi); break;            \
    case 4: span_tokens(4, F, part, wb, nrt, cp, xt, src, n, cols, pfi); break;            \
    case 5: span_tokens(5, F, part, wb, nrt, cp, xt, src, n, cols, pfi); break;            \
    default: span_tokens(6, F, part, wb, nrt, cp, xt, src, n, cols, pfi); break;           \
    }
            if (f32) {
                K3_SPAN_M(1)
            } else {
                K3_SPAN_M(0)
            }
#undef K3_SPAN_M
            for (int64_t j = 0; j < m; ++j) {
                float *yj = y + (t0 + j) * rows + s0;
                int64_t r = 0;
                for (; r + K3_PR <= n; r += K3_PR) {
                    __m512d(*a)[SPAN_T][4] = part[r / K3_PR];
                    _mm_storeu_ps(yj + r, _mm256_cvtpd_ps(fold512_4(a[0][j], a[1][j], a[2][j], a[3][j])));
                }
                for (; r < n; ++r) {
                    const __m512d *a = part[r / K3_PR][r % K3_PR][j];
                    yj[r] = (float)fold512(a[0], a[1], a[2], a[3]);
                }
            }
            t0 += m;
        }
    }
}

/* The three weight kinds as separate functions, so each inner loop is specialised. */
K3_AVX512 static void k3__span512_bf16(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                                       int64_t rows, int64_t cols, int64_t cp, const double *xd,
                                       int64_t nt, float *y) {
    k3__span512(K3_W_BF16, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
K3_AVX512 static void k3__span512_f32(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                                      int64_t rows, int64_t cols, int64_t cp, const double *xd,
                                      int64_t nt, float *y) {
    k3__span512(K3_W_F32, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
K3_AVX512 static void k3__span512_mxfp4(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                                        int64_t rows, int64_t cols, int64_t cp, const double *xd,
                                        int64_t nt, float *y) {
    k3__span512(K3_W_MXFP4, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
