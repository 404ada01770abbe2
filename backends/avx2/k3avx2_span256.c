/* k3avx2_span256.c - the AVX2 multi-token products over spans of rows, their activations in
 * eighth-major order (k3avx2_matmul.c's K3_PATH_SPAN256, on CPUs without AVX-512; the
 * AVX-512 ones are k3avx2_span512.c's, and k3avx2_matmul256.c has the tiles these replace
 * from span2_min_tokens on).
 *
 * Eighth-major order. Lane register k (k = 0..7) of a (row, token) sum only ever receives
 * the columns 32c + 4k .. 32c + 4k + 3, in increasing c (the lane-pass tiles of
 * k3avx2_matmul256.c). Here the activations are widened with those columns side by side:
 * column 32c + 4k + i of a token's cp columns sits at k * (cp / 8) + 4c + i, so eighth k of
 * the row is everything lane register k adds, contiguous, and the rows' float64 copies are
 * laid out the same way. A (row, token) sum is then eight plain four-lane dot products of
 * cp / 8 columns, one per eighth, each adding its terms in increasing column order from +0.0
 * with the one-token kernels' FMA (the product of a float32 and a bf16, float32 or MXFP4
 * value is exact in float64), and the fold is k3_lanes_fold's: the bits are the one-token
 * kernels', token by token. MXFP4 rows are decoded straight to float64 a 32-column group at
 * a time (k3avx2_mxfp4.c decode_group: two table shuffles and one spread per register), its
 * eight registers stored as they come, each holding its four columns in MX_PERM order; the
 * activations are widened in the same order (span256_mx_index) and the fold is fold_mx's.
 *
 * Why spans. The lane-pass tiles take four rows at a time: for every four rows they read
 * each token tile's activations from L2 or L3 again (128 tokens of 1536 columns are 1.5 MiB
 * of float64, more than a Zen 2 or Zen 3 core's L2), and their inner loop widens float32
 * weights (`vcvtps2pd` from memory) beside the FMAs. Here a job's rows go in spans of
 * SPAN2_ROWS: the span's rows are decoded once into a float64 copy laid out block by block
 * (span2_at), and then, for each group of SPAN2_GT token tiles, each eighth and each block of
 * SPAN2_EB of its columns, the span's slice of the block (15 rows, 22.5 KiB) stays in L1 while
 * every tile of SPAN2_T tokens passes over it, three rows at a time; each tile's lane
 * registers wait in the scratch between blocks. (The copy's rows had been cp doubles apart
 * and each token tile had walked all the span's blocks: at 1,536 columns a block's rows fell
 * into the same L1 sets, and the copy was read from L2 again for every tile. One Zen 2 core,
 * three alternating rounds, GMAC/s: bf16 [1536 x 7232] x 128 16.7-17.6 -> 17.4-18.4, the 64
 * experts of a medium MoE layer 12.3-12.5 -> 13.0-13.5, MXFP4 [672 x 768] x 16 15.2-15.3 ->
 * 16.2-16.8.) A tile keeps 12 accumulators, three tokens' activation vectors and one weight
 * vector in the 16 ymm registers, the fourth token's activations are the FMAs' memory operand,
 * and its inner loop is loads and FMAs only. Three rows by four tokens read a weight vector
 * from the span's copy for every four FMAs, where four rows by three tokens read one for
 * every three: a loop of the span tiles' shape (a 16- or 15-row copy of 1,536 columns in L2,
 * 128 tokens from L3), one Zen 2 core, 4 x 3 19.8-20.6 GMAC/s, 3 x 4 21.5-22.1. Tiles of
 * twelve accumulators for every token count (4 x 3 for three tokens, 6 x 2 for two, 12 x 1
 * for one, over 12-row spans) measured 3-10 % slower on the experts than the threes below.
 * Standalone, one Zen 2 core (FMA peak 26 G/s), four rows by three tokens over 512 columns in
 * L1: float32 weights widened in the loop 15.2 GMAC/s, float64 weights 17-18, 25 from L1.
 */
#include "k3avx2_internal.h"

#define SPAN2_R 3     /* rows per tile */
#define SPAN2_ROWS 15 /* rows per span (a multiple of SPAN2_R; k3avx2_matmul.c's row_chunk) */
#define SPAN2_T 4     /* tokens per tile */
/* Columns of an eighth per block: the span's 15 rows of them are 22.5 KiB, and a [. x 1536]
 * matrix's eighth (192 columns) is one block. One Zen 2 core, bf16 x 128 tokens, two
 * alternating rounds, GMAC/s for blocks of 128 / 192 / 256: [1536 x 1536] 20.4-20.5 /
 * 21.2-21.3 / 20.7, [7232 x 1536] 21.0-21.2 / 21.9-22.0 / 21.2-21.4, [1536 x 7232] 20.5-20.6
 * / 20.7-20.8 / 19.9-20.3 (two threads: 38.4-42.2 / 40.2-44.3 / 39.3-42.8); the medium
 * model's routed experts (768 and 672 columns, one block either way) within noise. */
#define SPAN2_EB 192
#define SPAN2_GT 8    /* token tiles per group (their accumulators live in the scratch) */
/* The span tiles' token blocks (k3avx2_matmul.c's token_block): a span's copy stays in L2
 * while every tile of the block's tokens passes over it, so the activations need not fit
 * L2. One Zen 2 core, bf16 [1536 x 7232] x 128 tokens: blocks of 640 KiB (11 tokens, each
 * span decoded twelve times) 12.8 GMAC/s, 2 MiB 15.9, 4 MiB 17.0, 8 MiB 16.5. */
#define SPAN2_XBLOCK_BYTES (4 << 20)
/* The span tiles from this many tokens on; below it the lane-pass tiles of
 * k3avx2_matmul256.c are faster (a span's copy is decoded for too few tokens). One Zen 2
 * core, [1536 x 1536] bf16 and [768 x 1536] MXFP4, GMAC/s span / lane-pass: bf16 2 tokens
 * 6.3-6.6 / 6.0-6.2, 3 tokens 8.6-8.8 / 7.6-7.8, 16 tokens 15.1-15.5 / 12.2-12.4. MXFP4
 * [672 x 768] (the medium model's experts), the copy decoded straight to float64: 2 tokens
 * 5.5-5.6 / 5.8, 3 tokens 7.8-7.9 / 7.2, 4 tokens 8.1-8.3 / 7.6-7.8, 8 tokens 11.9-12.0 /
 * 10.3-10.4 (the copy had been decoded to float32 and widened: then the lane-pass tiles won
 * up to 9 tokens). */
#define SPAN2_MIN_TOKENS 2
#define SPAN2_MIN_TOKENS_MXFP4 3
#define K3_SI static inline __attribute__((always_inline))

/* The fewest tokens that take the span tiles for weights of `kind`. */
static inline int64_t span2_min_tokens(enum k3_wkind kind) {
    return kind == K3_W_MXFP4 ? SPAN2_MIN_TOKENS_MXFP4 : SPAN2_MIN_TOKENS;
}

/* Where column i of a row of cp columns goes in eighth-major order. */
static inline int64_t span256_index(int64_t i, int64_t cp) {
    return ((i & 31) >> 2) * (cp / 8) + ((i >> 5) << 2) + (i & 3);
}

/* Where column i goes for MXFP4 weights: eighth-major with the four columns of each eighth's
 * step in MX_PERM order (k3avx2_mxfp4.c decode_group's registers, stored as they come). */
static inline int64_t span256_mx_index(int64_t i, int64_t cp) {
    return span256_index((i & ~(int64_t)3) + MX_PERM[i & 3], cp); /* MX_PERM is its own inverse */
}

/* The lane sum of a (row, token): an MXFP4 one has its lanes in MX_PERM order. */
K3_SI double span2_fold(enum k3_wkind kind, const k3_lanes *L) {
    return kind == K3_W_MXFP4 ? fold_mx(L) : k3_lanes_fold(L);
}

/* The span's copy, block-major: for each eighth k and each block of SPAN2_EB of its columns,
 * the span's SPAN2_ROWS rows of that block side by side (SPAN2_EB doubles apart), so the
 * slice every tile of a block multiplies is in one piece. (Rows cp doubles apart put
 * a block's rows in the same few L1 sets whenever cp * 8 is a multiple of 4 KiB, as at 1,536
 * columns, and they evicted each other.) An eighth is span2_eighth(cp) doubles long. */
static inline int64_t span2_eighth(int64_t cp) {
    return (cp / 8 + SPAN2_EB - 1) / SPAN2_EB * SPAN2_ROWS * SPAN2_EB;
}

/* Where four-column step c of eighth k of a row (its first double at out) sits in the copy. */
K3_SI double *span2_at(double *out, int64_t e, int k, int64_t c) {
    return out + k * e + c / (SPAN2_EB / 4) * (SPAN2_ROWS * SPAN2_EB) + 4 * (c % (SPAN2_EB / 4));
}

/* Thirty-two float32 values (natural column order) widened into chunk c of a row of the
 * span's copy (its eighths e doubles apart). */
K3_SI void span2_put_f32(double *out, int64_t e, int64_t c, const float *v) {
    for (int k = 0; k < 8; ++k)
        _mm256_store_pd(span2_at(out, e, k, c), _mm256_cvtps_pd(_mm_loadu_ps(v + 4 * k)));
}

/* Row `row` of a matrix as one eighth-major float64 row of cp doubles (+0.0 from column
 * `cols` on): the weights the lane-pass tiles multiply, exact for every MXFP4 scale byte;
 * an MXFP4 row in span256_mx_index's order. */
K3_SI void span2_row(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t row,
                     int64_t cols, int64_t cp, double *out) {
    const int64_t e = span2_eighth(cp), whole = cols / 32;
    float v[32] __attribute__((aligned(32)));
    if (kind == K3_W_BF16) {
        const uint16_t *src = (const uint16_t *)w + row * cols;
        const __m128i z = _mm_setzero_si128();
        for (int64_t c = 0; c < whole; ++c) {
            const uint16_t *s = src + 32 * c;
            _mm_prefetch((const char *)s + PREFETCH512_BF16, _MM_HINT_T1);
            for (int q = 0; q < 4; ++q) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(s + 8 * q));
                _mm_store_si128((__m128i *)(v + 8 * q), _mm_unpacklo_epi16(z, b));
                _mm_store_si128((__m128i *)(v + 8 * q + 4), _mm_unpackhi_epi16(z, b));
            }
            span2_put_f32(out, e, c, v);
        }
    } else if (kind == K3_W_F32) {
        const float *src = (const float *)w + row * cols;
        for (int64_t c = 0; c < whole; ++c) {
            _mm_prefetch((const char *)(src + 32 * c) + PREFETCH512_AHEAD, _MM_HINT_T1);
            span2_put_f32(out, e, c, src + 32 * c);
        }
    } else { /* MXFP4: each group decoded straight to float64, its columns in MX_PERM order
              * inside each eighth's four (the activations are widened to match) */
        const uint8_t *pk = (const uint8_t *)w + row * (cols / 2), *sb = sc + row * whole;
        for (int64_t c = 0; c < whole; ++c) {
            __m256d q[8];
            if ((c & 3) == 0) _mm_prefetch((const char *)(pk + 16 * c) + PREFETCH512_AHEAD, _MM_HINT_T1);
            if (g_tables_exact) {
                decode_group(q, pk + 16 * c, sb[c]);
            } else {
                double d[32] __attribute__((aligned(32)));
                decode_group_scalar(d, pk + 16 * c, sb[c]);
                for (int k = 0; k < 8; ++k) q[k] = _mm256_load_pd(d + 4 * k);
            }
            for (int k = 0; k < 8; ++k) _mm256_store_pd(span2_at(out, e, k, c), q[k]);
        }
    }
    if (whole * 32 < cp) { /* the column tail (bf16 and float32 only: MXFP4 rows are whole) */
        for (int i = 0; i < 32; ++i) {
            const int64_t col = 32 * whole + i;
            float f = 0.0f;
            if (col < cols && kind == K3_W_BF16) {
                const uint32_t u = (uint32_t)((const uint16_t *)w)[row * cols + col] << 16;
                memcpy(&f, &u, 4);
            } else if (col < cols) {
                f = ((const float *)w)[row * cols + col];
            }
            v[i] = f;
        }
        span2_put_f32(out, e, whole, v);
    }
}

/* n4 four-column steps of one eighth block: three rows of the copy (w, cp doubles apart)
 * against NT tokens (x, cp doubles apart), added to acc. With four tokens the compiler keeps
 * three activation vectors in registers and takes the fourth as the FMAs' memory operand
 * (12 accumulators, 3 activations and 1 weight vector are the 16 ymm registers). */
K3_SI void span2_block(const int NT, __m256d acc[SPAN2_R][SPAN2_T], const double *w,
                       const double *x, int64_t cp, int64_t n4) {
    for (int64_t s = 0; s < n4; ++s) {
        __m256d xv[SPAN2_T];
        for (int j = 0; j < NT; ++j) xv[j] = _mm256_loadu_pd(x + j * cp + 4 * s);
        for (int r = 0; r < SPAN2_R; ++r) {
            const __m256d q = _mm256_load_pd(w + r * SPAN2_EB + 4 * s);
            for (int j = 0; j < NT; ++j) acc[r][j] = _mm256_fmadd_pd(q, xv[j], acc[r][j]);
        }
    }
}

/* One block of an eighth for one token tile: the nrt three-row tiles of the span's copy
 * (wb, this eighth block's first column) against NT tokens (x), each tile's accumulators
 * continued from acc (zero at the eighth's first block) and stored back. */
K3_SI void span2_tile(const int NT, __m256d (*acc)[SPAN2_R][SPAN2_T], const double *wb,
                      int64_t nrt, int64_t cp, const double *x, int64_t n4, int first) {
    for (int64_t rt = 0; rt < nrt; ++rt) {
        __m256d a[SPAN2_R][SPAN2_T];
        for (int r = 0; r < SPAN2_R; ++r)
            for (int j = 0; j < NT; ++j) a[r][j] = first ? _mm256_setzero_pd() : acc[rt][r][j];
        span2_block(NT, a, wb + rt * SPAN2_R * SPAN2_EB, x, cp, n4);
        for (int r = 0; r < SPAN2_R; ++r)
            for (int j = 0; j < NT; ++j) acc[rt][r][j] = a[r][j];
    }
}

/* Weight `col` of row `row`, widened on its own (the path without scratch). */
K3_SI double span2_weight(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t row,
                          int64_t cols, int64_t col) {
    if (kind == K3_W_MXFP4) {
        const int byte = ((const uint8_t *)w)[row * (cols / 2) + col / 2];
        return WV512[sc[row * (cols / 32) + col / 32]][(col & 1) ? byte >> 4 : byte & 15];
    }
    if (kind == K3_W_BF16) {
        const uint32_t u = (uint32_t)((const uint16_t *)w)[row * cols + col] << 16;
        float f;
        memcpy(&f, &u, 4);
        return (double)f;
    }
    return (double)((const float *)w)[row * cols + col];
}

/* Row `row` for nt tokens of eighth-major xd (span256_mx_index's order for MXFP4), each
 * weight widened on its own (a thread without scratch for a span's copy). */
K3_SI void span2_row_scalar(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t row,
                            int64_t rows, int64_t cols, int64_t cp, const double *xd, int64_t nt,
                            float *y) {
    const int64_t e = cp / 8;
    for (int64_t t = 0; t < nt; ++t) {
        k3_lanes L;
        k3_lanes_zero(&L);
        const double *xt = xd + t * cp;
        for (int64_t c = 0; 32 * c < cp; ++c) {
            double q[32] __attribute__((aligned(32)));
            for (int i = 0; i < 32; ++i) {
                const int64_t col = 32 * c + (kind == K3_W_MXFP4 ? (i & ~3) + MX_PERM[i & 3] : i);
                q[i] = col < cols ? span2_weight(kind, w, sc, row, cols, col) : 0.0;
            }
            for (int k = 0; k < 8; ++k)
                L.a[k] = _mm256_fmadd_pd(_mm256_load_pd(q + 4 * k),
                                         _mm256_loadu_pd(xt + k * e + 4 * c), L.a[k]);
        }
        y[t * rows + row] = (float)span2_fold(kind, &L);
    }
}

/* Rows o .. o + nr - 1 (any nr >= 1) for the nt tokens of an eighth-major block (xd: nt x cp;
 * y[t * rows + r]), a span of SPAN2_ROWS at a time. */
K3_SI void k3__span256(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                       int64_t nr, int64_t rows, int64_t cols, int64_t cp, const double *xd,
                       int64_t nt, float *y) {
    const int64_t ek = span2_eighth(cp); /* an eighth's doubles in the span's copy */
    const size_t copy = (size_t)(8 * ek) * sizeof(double);
    const size_t accs =
        (size_t)(8 * SPAN2_GT * SPAN2_ROWS / SPAN2_R) * sizeof(__m256d[SPAN2_R][SPAN2_T]);
    char *scr = (char *)k3__scratch(copy + accs);
    if (!scr) { /* no scratch for a span's copy */
        for (int64_t r = o; r < o + nr; ++r)
            span2_row_scalar(kind, w, sc, r, rows, cols, cp, xd, nt, y);
        return;
    }
    double *wb = (double *)scr;
    __m256d (*acc)[SPAN2_R][SPAN2_T] = (__m256d (*)[SPAN2_R][SPAN2_T])(scr + copy);
    const int64_t e = cp / 8;
    for (int64_t s0 = o; s0 < o + nr; s0 += SPAN2_ROWS) {
        const int64_t n = o + nr - s0 < SPAN2_ROWS ? o + nr - s0 : SPAN2_ROWS;
        const int64_t nrt = (n + SPAN2_R - 1) / SPAN2_R;
        for (int64_t r = 0; r < nrt * SPAN2_R; ++r) {
            if (r < n)
                span2_row(kind, w, sc, s0 + r, cols, cp, wb + r * SPAN2_EB);
            else
                for (int64_t q = r * SPAN2_EB; q < 8 * ek; q += SPAN2_ROWS * SPAN2_EB)
                    memset(wb + q, 0, SPAN2_EB * sizeof(double));
        }
        for (int64_t g0 = 0; g0 < nt;) {
            /* a group of up to SPAN2_GT token tiles: tiles of four tokens, but five, six or
             * nine left go in threes (3 + 2, 3 + 3, 3 + 3 + 3): a tile of one or two tokens
             * has too few independent FMA chains */
            int64_t t0s[SPAN2_GT], ms[SPAN2_GT], ng = 0, t0 = g0;
            for (; ng < SPAN2_GT && t0 < nt; ++ng) {
                const int64_t left = nt - t0;
                ms[ng] = left == 5 || left == 6 || left == 9 ? 3 : left < SPAN2_T ? left : SPAN2_T;
                t0s[ng] = t0;
                t0 += ms[ng];
            }
            /* eighth by eighth and block by block, the span's slice of the block (at most
             * 15 x SPAN2_EB doubles) stays in L1 while every tile of the group passes over it */
            for (int k = 0; k < 8; ++k)
                for (int64_t b = 0; b < e; b += SPAN2_EB) {
                    const int64_t n4 = (e - b < SPAN2_EB ? e - b : SPAN2_EB) / 4;
                    const double *wk = wb + k * ek + b / SPAN2_EB * (SPAN2_ROWS * SPAN2_EB);
                    for (int64_t g = 0; g < ng; ++g) {
                        __m256d (*ag)[SPAN2_R][SPAN2_T] =
                            acc + (k * SPAN2_GT + g) * (SPAN2_ROWS / SPAN2_R);
                        const double *xt = xd + t0s[g] * cp + k * e + b;
                        _Static_assert(SPAN2_T == 4, "the token counts spelled out below");
                        switch (ms[g]) {
                        case 1: span2_tile(1, ag, wk, nrt, cp, xt, n4, b == 0); break;
                        case 2: span2_tile(2, ag, wk, nrt, cp, xt, n4, b == 0); break;
                        case 3: span2_tile(3, ag, wk, nrt, cp, xt, n4, b == 0); break;
                        default: span2_tile(4, ag, wk, nrt, cp, xt, n4, b == 0); break;
                        }
                    }
                }
            for (int64_t g = 0; g < ng; ++g)
                for (int64_t r = 0; r < n; ++r)
                    for (int64_t j = 0; j < ms[g]; ++j) {
                        k3_lanes L;
                        for (int k = 0; k < 8; ++k)
                            L.a[k] = acc[(k * SPAN2_GT + g) * (SPAN2_ROWS / SPAN2_R) + r / SPAN2_R]
                                        [r % SPAN2_R][j];
                        y[(t0s[g] + j) * rows + s0 + r] = (float)span2_fold(kind, &L);
                    }
            g0 = t0;
        }
    }
}

/* The three weight kinds as separate functions, so each inner loop is specialised. */
static void k3__span256_bf16(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                             int64_t rows, int64_t cols, int64_t cp, const double *xd, int64_t nt,
                             float *y) {
    k3__span256(K3_W_BF16, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
static void k3__span256_f32(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                            int64_t rows, int64_t cols, int64_t cp, const double *xd, int64_t nt,
                            float *y) {
    k3__span256(K3_W_F32, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
static void k3__span256_mxfp4(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                              int64_t rows, int64_t cols, int64_t cp, const double *xd,
                              int64_t nt, float *y) {
    k3__span256(K3_W_MXFP4, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
