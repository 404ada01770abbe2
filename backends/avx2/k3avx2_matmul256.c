/* k3avx2_matmul256.c - the multi-token matrix products on AVX2 + FMA (the CPUs without
 * AVX-512; k3avx2_matmul512.c has the AVX-512 ones, k3avx2_matmul.c the one-token rows).
 *
 * Lane-pass tiles of four ymm lanes. Lane register k (k = 0..7) of a (row, token) sum only
 * ever receives the columns 32c + 4k .. 32c + 4k + 3 (c = 0, 1, ...), in increasing c, so the
 * eight registers of the contract's 32 float64 lanes can be computed one after the other:
 * pass k walks the row's chunks adding those four columns, and its register is kept for the
 * fold. Each lane adds its terms in increasing column order from +0.0, every update is the
 * one-token kernels' FMA (the product of a float32 and a bf16 or float32 value is exact in
 * float64, so one rounding), and the fold is k3_lanes_fold's: the bits are row_bf16's and
 * row_f32's, token by token.
 *
 * What it buys is registers. A tile of K3_PR (4) rows and P2_T (3) tokens keeps one
 * accumulator per (row, token) - 12 ymm - beside the three tokens' activation vectors and
 * one weight vector: each weight vector feeds three FMAs, each loaded activation vector four.
 *
 * The weights come from float32 copies, so the inner loop widens four weights with one
 * `vcvtps2pd` from memory and no integer shuffle (the one-token kernels' bf16 widening, two
 * shuffles per four weights, queues on the ports the FMAs share). A tile's bf16 or float32
 * rows are converted once for all the tokens of the block (twelve tokens or fewer: a
 * 512-column block at a time, into a buffer that stays in L1); MXFP4 rows through mx_to_f32
 * (k3avx2_matmul512.c: exact for every scale byte up to MX_F32_MAX_SCALE), and a tile with a
 * larger scale byte (2^126 and up, or the NaN byte) takes mx_row_scalar, one table lookup per
 * weight in natural column order. The columns go in blocks of P2_CB, whose weights and one
 * token tile's activations stay in L1 across the eight passes; the accumulators are carried
 * from block to block, so each lane's terms still come in increasing column order.
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

/* Columns [c0, c0 + nc) of nr rows (bf16 or float32, rows `rs` bytes apart from rb) as
 * float32 rows `os` floats apart in wb, +0.0 from column `cols` on. */
K3_AI void p2_convert(enum k3_wkind kind, int64_t nr, const uint8_t *rb, int64_t rs,
                      int64_t c0, int64_t cols, int64_t nc, float *wb, int64_t os) {
    const int64_t n = cols - c0 < nc ? cols - c0 : nc;
    for (int64_t r = 0; r < nr; ++r) {
        float *out = wb + r * os;
        int64_t i = 0;
        if (kind == K3_W_BF16) {
            const uint16_t *src = (const uint16_t *)(rb + r * rs) + c0;
            const __m128i z = _mm_setzero_si128();
            for (; i + 8 <= n; i += 8) {
                if ((i & 31) == 0) /* one line of bf16 per 32 columns */
                    _mm_prefetch((const char *)(src + i) + PREFETCH512_BF16, _MM_HINT_T1);
                const __m128i v = _mm_loadu_si128((const __m128i *)(src + i));
                _mm_storeu_si128((__m128i *)(out + i), _mm_unpacklo_epi16(z, v));
                _mm_storeu_si128((__m128i *)(out + i + 4), _mm_unpackhi_epi16(z, v));
            }
            for (; i < n; ++i) {
                const uint32_t u = (uint32_t)src[i] << 16;
                memcpy(out + i, &u, 4);
            }
        } else {
            const float *src = (const float *)(rb + r * rs) + c0;
            memcpy(out, src, (size_t)n * sizeof(float));
            i = n;
        }
        for (; i < nc; ++i) out[i] = 0.0f;
    }
}

/* NR rows (their first at rb, rows `rs` bytes apart; or `cpy`, the rows' float32 copy, `cs`
 * floats apart, zero-padded to cp) for nt tokens of xd: y[t * rows + r]. Tokens go in groups
 * of P2_G tiles; for each group the columns go in blocks of P2_CB, whose weights (converted
 * once for the group where there is no copy) and activations stay in L1 across the eight
 * passes of every tile. */
K3_AI void p2_rows(enum k3_wkind kind, const int NR, const uint8_t *rb, int64_t rs,
                   const float *cpy, int64_t cs, int64_t rows, int64_t cols, int64_t cp,
                   const double *xd, int64_t nt, float *y) {
    float wb[K3_PR * P2_CB] __attribute__((aligned(32)));
    for (int64_t t0 = 0; t0 < nt; t0 += P2_T * P2_G) {
        const int64_t ng = nt - t0 < P2_T * P2_G ? nt - t0 : P2_T * P2_G;
        __m256d part[P2_G][K3_PR][P2_T][8];
        for (int g = 0; g * P2_T < ng; ++g)
            for (int r = 0; r < NR; ++r)
                for (int j = 0; j < P2_T; ++j)
                    for (int k = 0; k < 8; ++k) part[g][r][j][k] = _mm256_setzero_pd();
        for (int64_t c0 = 0; c0 < cp; c0 += P2_CB) {
            const int64_t nc = cp - c0 < P2_CB ? cp - c0 : P2_CB; /* whole chunks */
            const float *wf = wb;
            int64_t ws = P2_CB;
            if (cpy) {
                wf = cpy + c0;
                ws = cs;
            } else {
                p2_convert(kind, NR, rb, rs, c0, cols, nc, wb, P2_CB);
            }
            for (int g = 0; g * P2_T < ng; ++g) {
                const int64_t t = g * P2_T, n = ng - t < P2_T ? ng - t : P2_T;
                const double *x = xd + (t0 + t) * cp + c0;
                switch (n) {
                case 1: p2_block(NR, 1, part[g], wf, ws, nc / 32, x, cp); break;
                case 2: p2_block(NR, 2, part[g], wf, ws, nc / 32, x, cp); break;
                default: p2_block(NR, 3, part[g], wf, ws, nc / 32, x, cp); break;
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

/* Rows o .. o + nr - 1 (nr 1..K3_PR) for tokens 0 .. nt - 1 (nt >= 2) of a widened block (xd:
 * nt x cp float64, natural order). */
K3_AI void k3__row256(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                      int64_t nr, int64_t rows, int64_t cols, int64_t cp, const double *xd,
                      int64_t nt, float *y) {
    const float *cpy = NULL;
    int64_t cs = cols;
    const int64_t rs = kind == K3_W_BF16 ? 2 * cols : 4 * cols;
    const uint8_t *rb = kind == K3_W_MXFP4 ? NULL : (const uint8_t *)w + o * rs;
    if (kind == K3_W_MXFP4) {
        uint32_t *wb = (uint32_t *)k3__scratch((size_t)(K3_PR * cols) * sizeof(uint32_t));
        if (!wb || !mx_to_f32(wb, (const uint8_t *)w, sc, o, nr, cols)) {
            for (int64_t r = o; r < o + nr; ++r) mx_row_scalar(w, sc, r, rows, cols, cp, xd, nt, y);
            return;
        }
        cpy = (const float *)wb;
    } else if (nt > P2_T * P2_G) {
        /* more than one token group: the rows converted once for all of them, not once per
         * group and block (without scratch, per group and block) */
        float *wb = (float *)k3__scratch((size_t)(K3_PR * cp) * sizeof(float));
        if (wb) {
            p2_convert(kind, nr, rb, rs, 0, cols, cp, wb, cp);
            cpy = wb;
            cs = cp;
        }
    }
    _Static_assert(K3_PR == 4, "the row counts spelled out below");
    switch (nr) {
    case 1: p2_rows(kind, 1, rb, rs, cpy, cs, rows, cols, cp, xd, nt, y + o); break;
    case 2: p2_rows(kind, 2, rb, rs, cpy, cs, rows, cols, cp, xd, nt, y + o); break;
    case 3: p2_rows(kind, 3, rb, rs, cpy, cs, rows, cols, cp, xd, nt, y + o); break;
    default: p2_rows(kind, 4, rb, rs, cpy, cs, rows, cols, cp, xd, nt, y + o); break;
    }
}

/* The three weight kinds as separate functions, so each inner loop is specialised. */
static void k3__row256_bf16(const void *w, const uint8_t *sc, int64_t o, int64_t nr, int64_t rows,
                            int64_t cols, int64_t cp, const double *xd, int64_t nt, float *y) {
    k3__row256(K3_W_BF16, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
static void k3__row256_f32(const void *w, const uint8_t *sc, int64_t o, int64_t nr, int64_t rows,
                           int64_t cols, int64_t cp, const double *xd, int64_t nt, float *y) {
    k3__row256(K3_W_F32, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
static void k3__row256_mxfp4(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                             int64_t rows, int64_t cols, int64_t cp, const double *xd, int64_t nt,
                             float *y) {
    k3__row256(K3_W_MXFP4, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
