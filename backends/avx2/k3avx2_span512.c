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

/* Where column i of a row of cp columns goes in pass-major order. */
static inline int64_t span_index(int64_t i, int64_t cp) {
    return ((i & 31) >> 3) * (cp / 4) + ((i >> 5) << 3) + (i & 7);
}

/* Rows o .. o + n - 1 of a matrix as pass-major float64 rows of cp doubles (+0.0 from column
 * `cols` on) in wb, each 32-column chunk decoded by dec_chunk (the weights the lane-pass
 * tiles multiply, exact for every MXFP4 scale byte), and rows n .. n4 - 1 all +0.0. */
K3_INLINE512 void span_copy(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                            int64_t n, int64_t n4, int64_t cols, int64_t cp, double *wb) {
    const int64_t q = cp / 4;
    for (int64_t r = 0; r < n4; ++r) {
        double *out = wb + r * cp;
        if (r >= n) {
            memset(out, 0, (size_t)cp * sizeof(double));
            continue;
        }
        for (int64_t c = 0; 32 * c < cp; ++c) {
            __m512d v[4];
            prefetch_chunk(kind, w, sc, o + r, cols, c);
            dec_chunk(kind, v, w, sc, o + r, cols, c);
            for (int k = 0; k < 4; ++k) _mm512_storeu_pd(out + k * q + 8 * c, v[k]);
        }
    }
}

/* n8 eight-column steps of one quarter block: four rows of the copy (w, cp doubles apart)
 * against NT tokens (x, cp doubles apart), added to acc. */
K3_INLINE512 void span_block(const int NT, __m512d acc[K3_PR][SPAN_T], const double *w,
                             int64_t cp, const double *x, int64_t n8) {
    for (int64_t s = 0; s < n8; ++s) {
        __m512d xv[SPAN_T];
        for (int j = 0; j < NT; ++j) xv[j] = _mm512_loadu_pd(x + j * cp + 8 * s);
        for (int r = 0; r < K3_PR; ++r) {
            const __m512d q = _mm512_loadu_pd(w + r * cp + 8 * s);
            for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_fmadd_pd(q, xv[j], acc[r][j]);
        }
    }
}

/* NT tokens (x: the first one's pass-major activations) against the nrt four-row tiles of a
 * span's copy wb: part[rt][r][j][k] is lane register k of the (row 4rt + r, token j) sum. */
K3_INLINE512 void span_tokens(const int NT, __m512d part[SPAN_ROWS / K3_PR][K3_PR][SPAN_T][4],
                              const double *wb, int64_t nrt, int64_t cp, const double *x) {
    const int64_t q = cp / 4;
    for (int k = 0; k < 4; ++k)
        for (int64_t b = 0; b < q; b += SPAN_QB) {
            const int64_t n8 = (q - b < SPAN_QB ? q - b : SPAN_QB) / 8;
            for (int64_t rt = 0; rt < nrt; ++rt) {
                __m512d acc[K3_PR][SPAN_T];
                for (int r = 0; r < K3_PR; ++r)
                    for (int j = 0; j < NT; ++j)
                        acc[r][j] = b ? part[rt][r][j][k] : _mm512_setzero_pd();
                span_block(NT, acc, wb + rt * K3_PR * cp + k * q + b, cp, x + k * q + b, n8);
                for (int r = 0; r < K3_PR; ++r)
                    for (int j = 0; j < NT; ++j) part[rt][r][j][k] = acc[r][j];
            }
        }
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
    double *wb = (double *)k3__scratch((size_t)(SPAN_ROWS * cp) * sizeof(double));
    for (int64_t s0 = o; s0 < o + nr; s0 += SPAN_ROWS) {
        const int64_t n = o + nr - s0 < SPAN_ROWS ? o + nr - s0 : SPAN_ROWS;
        const int64_t nrt = (n + K3_PR - 1) / K3_PR;
        if (!wb) { /* no scratch for the copy */
            for (int64_t r = s0; r < s0 + n; ++r)
                span_row_scalar(kind, w, sc, r, rows, cols, cp, xd, nt, y);
            continue;
        }
        span_copy(kind, w, sc, s0, n, nrt * K3_PR, cols, cp, wb);
        for (int64_t t0 = 0; t0 < nt; t0 += SPAN_T) {
            const int64_t m = nt - t0 < SPAN_T ? nt - t0 : SPAN_T;
            __m512d part[SPAN_ROWS / K3_PR][K3_PR][SPAN_T][4];
            const double *xt = xd + t0 * cp;
            _Static_assert(SPAN_T == 6, "the token counts spelled out below");
            switch (m) {
            case 1: span_tokens(1, part, wb, nrt, cp, xt); break;
            case 2: span_tokens(2, part, wb, nrt, cp, xt); break;
            case 3: span_tokens(3, part, wb, nrt, cp, xt); break;
            case 4: span_tokens(4, part, wb, nrt, cp, xt); break;
            case 5: span_tokens(5, part, wb, nrt, cp, xt); break;
            default: span_tokens(6, part, wb, nrt, cp, xt); break;
            }
            for (int64_t r = 0; r < n; ++r)
                for (int64_t j = 0; j < m; ++j) {
                    const __m512d *a = part[r / K3_PR][r % K3_PR][j];
                    y[(t0 + j) * rows + s0 + r] = (float)fold512(a[0], a[1], a[2], a[3]);
                }
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
