/* k3avx2_matmul256.c - the multi-token matrix products on AVX2 + FMA (the CPUs without
 * AVX-512; k3avx2_matmul512.c has the AVX-512 ones, k3avx2_matmul.c the one-token rows).
 *
 * Lane-pass tiles of four ymm lanes. Lane register k (k = 0..7) of a (row, token) sum only
 * ever receives the columns 32c + 4k .. 32c + 4k + 3 (c = 0, 1, ...), in increasing c, so the
 * eight registers of the contract's 32 float64 lanes can be computed one after the other:
 * pass k walks the row's chunks adding those four columns, and its register is kept for the
 * fold. Each lane adds its terms in increasing column order from +0.0, every update is the
 * one-token kernels' FMA (the product of a float32 and an MXFP4 value is exact in float64, so
 * one rounding), and the fold is k3_lanes_fold's: the bits are the one-token MXFP4 rows',
 * token by token.
 *
 * What it buys is registers. A tile of K3_PR (4) rows and P2_T (3) tokens keeps one
 * accumulator per (row, token) - 12 ymm - beside the three tokens' activation vectors and
 * one weight vector: each weight vector feeds three FMAs, each loaded activation vector four.
 *
 * The weights come from float32 copies, so the inner loop widens four weights with one
 * `vcvtps2pd` from memory and no integer shuffle. Only MXFP4 rows of two tokens come
 * here (bf16 and float32 rows of two tokens or more, and MXFP4 from three, take the span tiles
 * of k3avx2_span256.c): a tile's rows are decoded through mx_to_f32 (k3avx2_matmul512.c: exact
 * for every scale byte up to MX_F32_MAX_SCALE), and a tile with a larger scale byte (2^126 and
 * up, or the NaN byte) takes mx_row_scalar, one table lookup per weight in natural column
 * order. The columns go in blocks of P2_CB, whose weights and one token tile's activations
 * stay in L1 across the eight passes; the accumulators are carried from block to block, so
 * each lane's terms still come in increasing column order.
 */
#include "k3avx2_internal.h"

#define P2_T 3    /* tokens per tile */
#define P2_G 4    /* tiles per token group (their accumulators live through the blocks) */
#define P2_CB 512 /* columns per block */
#define K3_AI static inline __attribute__((always_inline))

/* One column block of a tile: NR float32 weight rows (wf, `ws` floats apart; nch whole
 * 32-column chunks, zero-padded) against NT tokens (token j's float64 activations of the
 * block at x + j * cp), added to the tile's lane registers part[r][j][k] pass by pass. */
K3_AI void p2_block(const int NR, const int NT, __m256d part[K3_PR][P2_T][8], const float *wf,
                    int64_t ws, int64_t nch, const double *x, int64_t cp) {
    for (int k = 0; k < 8; ++k) {
        __m256d acc[K3_PR][P2_T];
        for (int r = 0; r < NR; ++r)
            for (int j = 0; j < NT; ++j) acc[r][j] = part[r][j][k];
        for (int64_t c = 0; c < nch; ++c) {
            const int64_t col = 32 * c + 4 * k;
            __m256d xv[P2_T];
            for (int j = 0; j < NT; ++j) xv[j] = _mm256_loadu_pd(x + j * cp + col);
            for (int r = 0; r < NR; ++r) {
                const __m256d q = _mm256_cvtps_pd(_mm_loadu_ps(wf + r * ws + col));
                for (int j = 0; j < NT; ++j) acc[r][j] = _mm256_fmadd_pd(q, xv[j], acc[r][j]);
            }
        }
        for (int r = 0; r < NR; ++r)
            for (int j = 0; j < NT; ++j) part[r][j][k] = acc[r][j];
    }
}

/* NR rows of a float32 copy (`cpy`, rows `cs` floats apart, zero-padded to cp) for nt tokens
 * of xd: y[t * rows + r]. Tokens go in groups of P2_G tiles; for each group the columns go
 * in blocks of P2_CB, whose weights and activations stay in L1 across the eight passes of
 * every tile. */
K3_AI void p2_rows(const int NR, const float *cpy, int64_t cs, int64_t rows, int64_t cp,
                   const double *xd, int64_t nt, float *y) {
    for (int64_t t0 = 0; t0 < nt; t0 += P2_T * P2_G) {
        const int64_t ng = nt - t0 < P2_T * P2_G ? nt - t0 : P2_T * P2_G;
        __m256d part[P2_G][K3_PR][P2_T][8];
        for (int g = 0; g * P2_T < ng; ++g)
            for (int r = 0; r < NR; ++r)
                for (int j = 0; j < P2_T; ++j)
                    for (int k = 0; k < 8; ++k) part[g][r][j][k] = _mm256_setzero_pd();
        for (int64_t c0 = 0; c0 < cp; c0 += P2_CB) {
            const int64_t nc = cp - c0 < P2_CB ? cp - c0 : P2_CB; /* whole chunks */
            for (int g = 0; g * P2_T < ng; ++g) {
                const int64_t t = g * P2_T, n = ng - t < P2_T ? ng - t : P2_T;
                const double *x = xd + (t0 + t) * cp + c0;
                switch (n) {
                case 1: p2_block(NR, 1, part[g], cpy + c0, cs, nc / 32, x, cp); break;
                case 2: p2_block(NR, 2, part[g], cpy + c0, cs, nc / 32, x, cp); break;
                default: p2_block(NR, 3, part[g], cpy + c0, cs, nc / 32, x, cp); break;
                }
            }
        }
        for (int64_t t = 0; t < ng; ++t)
            for (int r = 0; r < NR; ++r) {
                k3_lanes L;
                for (int k = 0; k < 8; ++k) L.a[k] = part[t / P2_T][r][t % P2_T][k];
                y[(t0 + t) * rows + r] = (float)k3_lanes_fold(&L);
            }
    }
}

/* Row o of an MXFP4 matrix for nt tokens, a table lookup per weight in natural column order
 * (the tiles whose scales are past MX_F32_MAX_SCALE: 2^126 and up, or NaN). */
static void mx_row_scalar(const uint8_t *w, const uint8_t *sc, int64_t o, int64_t rows,
                          int64_t cols, int64_t cp, const double *xd, int64_t nt, float *y) {
    const int64_t groups = cols / 32;
    const uint8_t *pk = w + o * (cols / 2), *sb = sc + o * groups;
    for (int64_t t = 0; t < nt; ++t) {
        k3_lanes L;
        k3_lanes_zero(&L);
        const double *xt = xd + t * cp;
        for (int64_t g = 0; g < groups; ++g) {
            double q[32];
            for (int i = 0; i < 32; ++i) {
                const int byte = pk[16 * g + (i >> 1)];
                q[i] = WVAL[sb[g]][(i & 1) ? byte >> 4 : byte & 15];
            }
            for (int k = 0; k < 8; ++k)
                L.a[k] = _mm256_fmadd_pd(_mm256_loadu_pd(xt + 32 * g + 4 * k),
                                         _mm256_loadu_pd(q + 4 * k), L.a[k]);
        }
        y[t * rows + o] = (float)k3_lanes_fold(&L);
    }
}

/* MXFP4 rows o .. o + nr - 1 (nr 1..K3_PR) for tokens 0 .. nt - 1 (nt >= 2) of a widened
 * block (xd: nt x cp float64, natural order). */
static void k3__row256_mxfp4(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                             int64_t rows, int64_t cols, int64_t cp, const double *xd, int64_t nt,
                             float *y) {
    uint32_t *wb = (uint32_t *)k3__scratch((size_t)(K3_PR * cols) * sizeof(uint32_t));
    if (!wb || !mx_to_f32(wb, (const uint8_t *)w, sc, o, nr, cols)) {
        for (int64_t r = o; r < o + nr; ++r) mx_row_scalar(w, sc, r, rows, cols, cp, xd, nt, y);
        return;
    }
    const float *cpy = (const float *)wb;
    _Static_assert(K3_PR == 4, "the row counts spelled out below");
    switch (nr) {
    case 1: p2_rows(1, cpy, cols, rows, cp, xd, nt, y + o); break;
    case 2: p2_rows(2, cpy, cols, rows, cp, xd, nt, y + o); break;
    case 3: p2_rows(3, cpy, cols, rows, cp, xd, nt, y + o); break;
    default: p2_rows(4, cpy, cols, rows, cp, xd, nt, y + o); break;
    }
}
