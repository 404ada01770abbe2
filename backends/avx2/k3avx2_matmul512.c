/* k3avx2_matmul512.c - the multi-token matrix products on AVX-512 (chosen at run time when
 * the CPU has AVX-512 F/BW/VL/DQ; k3avx2_matmul.c keeps the AVX2 code for the others).
 *
 * Register blocking: each 32-column chunk of a weight row (bf16, float32 or one MXFP4 group)
 * is decoded ONCE into four zmm registers of float64 weights and applied to up to four
 * tokens, whose 32 lanes each live in four more zmm registers (register k holds lanes
 * 8k..8k+7, natural column order). Each token's lanes add their terms in increasing column
 * order exactly as the T == 1 kernels do, and the fold is the contract's, so every output is
 * the same lane-ordered sum as the single-token product (the same bits).
 *
 * The lane update is an FMA: the product of a float32 by a bf16, float32 or MXFP4 value is
 * exact in float64, so acc + w*x rounded once (FMA) equals the product (exact) added with
 * one rounding (docs/kernel-contract.md section 2). Nowhere else is an FMA used.
 */
#include "k3avx2_internal.h"

#define K3_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define K3_INLINE512 K3_AVX512 static inline __attribute__((always_inline))

/* E2M1[c] * E8M0[b] as float64 (exact), 64-byte aligned rows: two zmm tables per byte. */
static double WV512[256][16] __attribute__((aligned(64)));

/* The same values as float32, the two bytes of the high half (the low half is zero) for
 * scale bytes 0..MX_F32_MAX_SCALE, where every one is a float32 exactly (see "MXFP4 row
 * tiles decoded once" below). */
#define MX_F32_MAX_SCALE 252
static uint8_t FLO512[MX_F32_MAX_SCALE + 1][16] __attribute__((aligned(16)));
static uint8_t FHI512[MX_F32_MAX_SCALE + 1][16] __attribute__((aligned(16)));
/* ... and whole, one zmm table per byte (the span tiles' float32 copies, k3avx2_span512.c) */
static float WF512[MX_F32_MAX_SCALE + 1][16] __attribute__((aligned(64)));

__attribute__((constructor)) static void k3__wv512_table(void) {
    for (int b = 0; b < 256; ++b)
        for (int c = 0; c < 16; ++c) {
            WV512[b][c] = K3C_E2M1[c] * K3C_E8M0[b];
            if (b > MX_F32_MAX_SCALE) continue;
            const float f = (float)WV512[b][c]; /* exact: at most three significant bits */
            uint32_t u;
            memcpy(&u, &f, 4);
            WF512[b][c] = f;
            FLO512[b][c] = (uint8_t)(u >> 16);
            FHI512[b][c] = (uint8_t)(u >> 24);
        }
}

/* The contract's fold of 32 lanes held as 4 x 8 (h = 16, 8 on registers, then 4, 2, 1). */
K3_INLINE512 double fold512(__m512d a0, __m512d a1, __m512d a2, __m512d a3) {
    a0 = _mm512_add_pd(a0, a2);
    a1 = _mm512_add_pd(a1, a3);
    a0 = _mm512_add_pd(a0, a1);
    __m256d s = _mm256_add_pd(_mm512_castpd512_pd256(a0), _mm512_extractf64x4_pd(a0, 1));
    double t[4];
    _mm256_storeu_pd(t, s);
    double s0 = t[0] + t[2], s1 = t[1] + t[3];
    return s0 + s1;
}

K3_INLINE512 void dec_bf16(__m512d q[4], const uint16_t *w) {
    for (int h = 0; h < 2; ++h) {
        __m512i v = _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + 16 * h))), 16);
        q[2 * h] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_castsi512_si256(v)));
        q[2 * h + 1] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(v, 1)));
    }
}

K3_INLINE512 void dec_f32(__m512d q[4], const float *w) {
    for (int k = 0; k < 4; ++k) q[k] = _mm512_cvtps_pd(_mm256_loadu_ps(w + 8 * k));
}

/* One MXFP4 group (16 packed bytes, scale byte b) in natural column order. Column i's code is
 * the nibble at bit 4i of the group read as two little-endian 64-bit words, so each word is
 * broadcast to every qword lane and shifted right by 4 x its column (vpsrlvq); the table
 * permute reads only the low four bits of each lane's index. Per group: two broadcast loads,
 * four shifts and four permutes, and no byte shuffles (which queued on one port before). */
K3_INLINE512 void dec_mxfp4(__m512d q[4], const uint8_t *pk, int b) {
    const __m512i s0 = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i s1 = _mm512_setr_epi64(32, 36, 40, 44, 48, 52, 56, 60);
    int64_t u0, u1;
    memcpy(&u0, pk, 8);
    memcpy(&u1, pk + 8, 8);
    const __m512i a = _mm512_set1_epi64(u0), c = _mm512_set1_epi64(u1); /* cols 0-15, 16-31 */
    const __m512d t0 = _mm512_load_pd(WV512[b]), t1 = _mm512_load_pd(WV512[b] + 8);
    q[0] = _mm512_permutex2var_pd(t0, _mm512_srlv_epi64(a, s0), t1);
    q[1] = _mm512_permutex2var_pd(t0, _mm512_srlv_epi64(a, s1), t1);
    q[2] = _mm512_permutex2var_pd(t0, _mm512_srlv_epi64(c, s0), t1);
    q[3] = _mm512_permutex2var_pd(t0, _mm512_srlv_epi64(c, s1), t1);
}

/* Chunk c of row o decoded into q (a column tail is completed with +0.0 weights). */
K3_INLINE512 void dec_chunk(enum k3_wkind kind, __m512d q[4], const void *w, const uint8_t *sc,
                            int64_t o, int64_t cols, int64_t c) {
    if (kind == K3_W_MXFP4) {
        dec_mxfp4(q, (const uint8_t *)w + o * (cols / 2) + 16 * c, sc[o * (cols / 32) + c]);
    } else if (kind == K3_W_BF16) {
        const uint16_t *r = (const uint16_t *)w + o * cols + 32 * c;
        if (32 * c + 32 <= cols) {
            dec_bf16(q, r);
        } else {
            uint16_t tail[32] = {0};
            memcpy(tail, r, (size_t)(cols - 32 * c) * sizeof(uint16_t));
            dec_bf16(q, tail);
        }
    } else {
        const float *r = (const float *)w + o * cols + 32 * c;
        if (32 * c + 32 <= cols) {
            dec_f32(q, r);
        } else {
            float tail[32] = {0};
            memcpy(tail, r, (size_t)(cols - 32 * c) * sizeof(float));
            dec_f32(q, tail);
        }
    }
}

/* Software prefetch into L2 of the weight stream: one 64-byte line per line of weights (4
 * MXFP4 groups, 1 bf16 chunk, half a float32 chunk) and one line of MXFP4 scale bytes per
 * 64 groups, 128 chunks ahead for MXFP4 and bf16 alike (2 KiB of packed MXFP4, 8 KiB of
 * bf16). Measured on a Zen 4 core, 1 thread, from DRAM: MXFP4 [3072 x 3584] x 1 at 5.9 GB/s
 * without, 6.9-7.2 GB/s with 2-4 KiB ahead; bf16 [672 x 768] x 16 tokens at 16.6-17.2
 * GMAC/s 2 KiB ahead, 19.2-20.0 8 KiB ahead (the rows of a lane-pass tile are short, so
 * 2 KiB was barely one tile ahead). */
#define PREFETCH512_AHEAD 2048 /* packed MXFP4 bytes, and float32 */
#define PREFETCH512_BF16 8192

/* One 64-byte line (bf16), half of one (float32), or a quarter of one plus, every 64
 * chunks, one line of scale bytes (MXFP4) of chunk c of row o, fetched into L2. */
K3_INLINE512 void prefetch_at(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                              int64_t cols, int64_t c) {
    if (kind == K3_W_MXFP4) {
        if ((c & 3) == 0) _mm_prefetch((const char *)w + o * (cols / 2) + 16 * c, _MM_HINT_T1);
        if ((c & 63) == 0) _mm_prefetch((const char *)sc + o * (cols / 32) + c, _MM_HINT_T1);
    } else if (kind == K3_W_BF16) {
        _mm_prefetch((const char *)w + 2 * (o * cols + 32 * c), _MM_HINT_T1);
    } else {
        const char *r = (const char *)w + 4 * (o * cols + 32 * c);
        _mm_prefetch(r, _MM_HINT_T1);
        _mm_prefetch(r + 64, _MM_HINT_T1);
    }
}

/* The stream's prefetch for chunk c of row o: prefetch_at the chunk PREFETCH512_AHEAD (bf16:
 * PREFETCH512_BF16) bytes further on (into the next row near a row's end). */
K3_INLINE512 void prefetch_chunk(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                                 int64_t cols, int64_t c) {
    const int64_t ahead = kind == K3_W_MXFP4 ? PREFETCH512_AHEAD / 16
                          : kind == K3_W_BF16 ? PREFETCH512_BF16 / 64
                                              : PREFETCH512_AHEAD / 128;
    prefetch_at(kind, w, sc, o, cols, c + ahead);
}

/* NR (1..2) rows o.. and NT (1..K3_NT) tokens: y[j * rows + r] = f32(lsum_i W[o + r, i] *
 * xd[j * cp + i]). Each chunk of each row is decoded once and applied to NT tokens; each
 * loaded chunk of a token's activations is applied to NR rows. */
#ifndef K3_NT
#define K3_NT 3
#endif
#ifndef K3_NR
#define K3_NR 2
#endif
#define MX_NT 4 /* MXFP4 tokens a one-row pass takes */
K3_INLINE512 void rows_tokens(enum k3_wkind kind, const int NR, const int NT, const void *w,
                              const uint8_t *sc, int64_t o, int64_t cols, int64_t cp,
                              const double *xd, int64_t rows, float *y) {
    __m512d acc[K3_NR][K3_NT > MX_NT ? K3_NT : MX_NT][4];
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < NT; ++j)
            for (int k = 0; k < 4; ++k) acc[r][j][k] = _mm512_setzero_pd();
    const int64_t chunks = cp / 32;
    for (int64_t c = 0; c < chunks; ++c) {
        __m512d q[K3_NR][4];
        for (int r = 0; r < NR; ++r) {
            prefetch_chunk(kind, w, sc, o + r, cols, c);
            dec_chunk(kind, q[r], w, sc, o + r, cols, c);
        }
        for (int k = 0; k < 4; ++k)
            for (int j = 0; j < NT; ++j) {
                const __m512d xv = _mm512_loadu_pd(xd + j * cp + 32 * c + 8 * k);
                for (int r = 0; r < NR; ++r)
                    acc[r][j][k] = _mm512_fmadd_pd(q[r][k], xv, acc[r][j][k]);
            }
    }
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < NT; ++j)
            y[j * rows + r] = (float)fold512(acc[r][j][0], acc[r][j][1], acc[r][j][2], acc[r][j][3]);
}

/* ---- lane-pass tiles: K3_PR rows x K3_PT tokens, one register per (row, token) ----------
 * Lane register k of a (row, token) sum only ever receives the columns 32c + 8k .. 32c + 8k + 7
 * (c = 0, 1, ...), in increasing c. So the four registers can be computed one after the
 * other: pass k walks the chunks adding those eight columns, and the pass's register is kept
 * for the fold. Each lane still adds its terms in increasing column order from +0.0, and the
 * fold is fold512's, so the bits are rows_tokens' (the same lane sum). What it buys is
 * registers: one accumulator per (row, token) instead of four, so 4 rows x 5 tokens (20
 * accumulators, 4 weight and 5 activation registers) share each decoded weight vector among
 * five tokens and each activation vector among four rows: 20 FMAs per 4 eight-column decodes,
 * where the 2 x 3 block does 24 per 8. Measured on a Zen 4 core, bf16 [1536 x 1536] x 30
 * tokens in cache: 25-27 GMAC/s against 19-21 (the FMA peak is 28.6). The rows of a tile
 * stay in L1/L2 across its four passes; pass 0 prefetches them. */
#define K3_PR 4
#define K3_PT 5

/* Eight bf16 weights at p as float64; `n` < 8 loads only n of them (+0.0 for the rest). */
K3_INLINE512 __m512d pass_bf16(const uint16_t *p, int n) {
    const __m128i v = n >= 8 ? _mm_loadu_si128((const __m128i *)p)
                             : _mm_maskz_loadu_epi16((__mmask8)((1u << n) - 1u), p);
    return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
}

/* The eight MXFP4 weights of group bytes g (4 bytes: columns 8k .. 8k + 7 of the group). */
K3_INLINE512 __m512d pass_mxfp4(const uint8_t *g, int b) {
    const __m512i sh = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
    uint32_t u;
    memcpy(&u, g, 4);
    const double *t = WV512[b];
    return _mm512_permutex2var_pd(_mm512_load_pd(t), _mm512_srlv_epi64(_mm512_set1_epi64(u), sh),
                                  _mm512_load_pd(t + 8));
}

/* Chunks [c0, c1) of pass k for the tile's rows (row r at byte rb[r] of the weights, its
 * scales at sb[r]) and tokens (xk: column 8k of token 0, token stride cp); `n` < 8 is the
 * width of a final partial step (bf16 only), `pf` prefetches the rows' lines. */
K3_INLINE512 void pass_run(enum k3_wkind kind, const int NT, __m512d acc[K3_PR][K3_PT],
                           const uint8_t *rb[K3_PR], const uint8_t *sb[K3_PR], int64_t c0,
                           int64_t c1, const int k, const int n, const int pf, const double *xk,
                           int64_t cp) {
    for (int64_t c = c0; c < c1; ++c) {
        __m512d q[K3_PR];
        for (int r = 0; r < K3_PR; ++r) {
            if (kind == K3_W_BF16) {
                const uint16_t *p = (const uint16_t *)rb[r] + 32 * c + 8 * k;
                if (pf) _mm_prefetch((const char *)p + PREFETCH512_BF16, _MM_HINT_T1);
                q[r] = pass_bf16(p, n);
            } else {
                const uint8_t *g = rb[r] + 16 * c + 4 * k;
                if (pf && (c & 3) == 0) _mm_prefetch((const char *)g + PREFETCH512_AHEAD, _MM_HINT_T1);
                q[r] = pass_mxfp4(g, sb[r][c]);
            }
        }
        const double *xc = xk + 32 * c;
        for (int j = 0; j < NT; ++j) {
            const __m512d xv = _mm512_loadu_pd(xc + j * cp);
            for (int r = 0; r < K3_PR; ++r) acc[r][j] = _mm512_fmadd_pd(q[r], xv, acc[r][j]);
        }
    }
}

/* Pass k of a tile: full eight-column steps, then a partial one where a bf16 row ends inside
 * it (columns past the row's end are +0.0 terms: leaving them out changes no lane). */
K3_INLINE512 void pass_k(enum k3_wkind kind, const int NT, __m512d part[K3_PR][K3_PT][4],
                         const uint8_t *rb[K3_PR], const uint8_t *sb[K3_PR], int64_t cols,
                         int64_t cp, const int k, const int pf, const double *xd) {
    __m512d acc[K3_PR][K3_PT];
    for (int r = 0; r < K3_PR; ++r)
        for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_pd();
    if (kind == K3_W_BF16) {
        const int64_t full = cols >= 8 * k + 8 ? (cols - 8 * k - 8) / 32 + 1 : 0;
        pass_run(kind, NT, acc, rb, sb, 0, full, k, 8, pf, xd + 8 * k, cp);
        const int64_t i = 32 * full + 8 * k; /* the next step's first column */
        if (i < cols)
            pass_run(kind, NT, acc, rb, sb, full, full + 1, k, (int)(cols - i), 0, xd + 8 * k, cp);
    } else {
        pass_run(kind, NT, acc, rb, sb, 0, cp / 32, k, 8, pf, xd + 8 * k, cp);
    }
    for (int r = 0; r < K3_PR; ++r)
        for (int j = 0; j < NT; ++j) part[r][j][k] = acc[r][j];
}

/* Rows o .. o + K3_PR - 1 of a bf16 or MXFP4 matrix for tokens 0 .. NT - 1 (NT <= K3_PT)
 * of xd (natural order, cp columns); pass 0 prefetches the rows. */
K3_INLINE512 void pass_tile(enum k3_wkind kind, const int NT, const void *w, const uint8_t *sc,
                            int64_t o, int64_t cols, int64_t cp, const double *xd, int64_t rows,
                            float *y) {
    __m512d part[K3_PR][K3_PT][4];
    const uint8_t *rb[K3_PR], *sb[K3_PR];
    for (int r = 0; r < K3_PR; ++r) {
        rb[r] = (const uint8_t *)w +
                (o + r) * (kind == K3_W_BF16 ? 2 * cols : cols / 2);
        sb[r] = kind == K3_W_MXFP4 ? sc + (o + r) * (cols / 32) : NULL;
    }
    pass_k(kind, NT, part, rb, sb, cols, cp, 0, 1, xd);
    pass_k(kind, NT, part, rb, sb, cols, cp, 1, 0, xd);
    pass_k(kind, NT, part, rb, sb, cols, cp, 2, 0, xd);
    pass_k(kind, NT, part, rb, sb, cols, cp, 3, 0, xd);
    for (int r = 0; r < K3_PR; ++r)
        for (int j = 0; j < NT; ++j)
            y[j * rows + o + r] =
                (float)fold512(part[r][j][0], part[r][j][1], part[r][j][2], part[r][j][3]);
}

/* ---- MXFP4 rows decoded once, to float32 (the AVX2 tiles) --------------------------------
 * An MXFP4 weight is E2M1 x 2^(b - 127), at most three significant bits: for every scale
 * byte b <= MX_F32_MAX_SCALE it is a float32 exactly, whose low half is zero (the smallest,
 * 2^-128, is a subnormal; the largest, 6 x 2^125, a normal). So the AVX2 tiles
 * (k3avx2_matmul256.c) decode a tile's groups once into a float32 copy (two byte shuffles
 * per group from per-scale tables of the high halves, then widening); each weight is then
 * the float64 dec_mxfp4 gives. On AVX-512 several MXFP4 tokens go through the span tiles'
 * float64 copies (k3avx2_span512.c) from SPAN_MIN_TOKENS on. */


/* The nr rows o.. of an MXFP4 matrix as float32 rows of `cols` (wb), or 0 where a scale
 * byte is past MX_F32_MAX_SCALE. AVX2 only, so the AVX2 tiles (k3avx2_matmul256.c) use it
 * too. */
static inline __attribute__((always_inline)) int mx_to_f32(uint32_t *wb, const uint8_t *w,
                                                           const uint8_t *sc, int64_t o,
                                                           int64_t nr, int64_t cols) {
    const int64_t chunks = cols / 32;
    const uint8_t *s0 = sc + o * chunks;
    for (int64_t i = 0; i < nr * chunks; ++i)
        if (s0[i] > MX_F32_MAX_SCALE) return 0;
    const __m128i m0f = _mm_set1_epi8(0x0F);
    for (int64_t r = 0; r < nr; ++r) {
        const uint8_t *rb = w + (o + r) * (cols / 2), *sb = s0 + r * chunks;
        uint32_t *out = wb + r * cols;
        for (int64_t c = 0; c < chunks; ++c) {
            if ((c & 3) == 0)
                _mm_prefetch((const char *)rb + 16 * c + PREFETCH512_AHEAD, _MM_HINT_T1);
            /* column 2i is the low nibble of byte i, column 2i + 1 the high one */
            const __m128i p = _mm_loadu_si128((const __m128i *)(rb + 16 * c));
            const __m128i lo = _mm_and_si128(p, m0f), hi = _mm_and_si128(_mm_srli_epi16(p, 4), m0f);
            const __m256i codes = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)), _mm_unpackhi_epi8(lo, hi), 1);
            const int b = sb[c];
            const __m256i L = _mm256_shuffle_epi8(
                _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)FLO512[b])), codes);
            const __m256i H = _mm256_shuffle_epi8(
                _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)FHI512[b])), codes);
            const __m256i w0 = _mm256_unpacklo_epi8(L, H), w1 = _mm256_unpackhi_epi8(L, H);
            /* high halves, w0: columns 0-7 | 16-23, w1: 8-15 | 24-31; as float32: a 0-3 |
             * 16-19, b2 4-7 | 20-23, d 8-11 | 24-27, e 12-15 | 28-31 */
            const __m256i z = _mm256_setzero_si256();
            const __m256i a = _mm256_unpacklo_epi16(z, w0), b2 = _mm256_unpackhi_epi16(z, w0);
            const __m256i d = _mm256_unpacklo_epi16(z, w1), e = _mm256_unpackhi_epi16(z, w1);
            uint32_t *oc = out + 32 * c;
            _mm256_storeu_si256((__m256i *)oc, _mm256_permute2x128_si256(a, b2, 0x20));
            _mm256_storeu_si256((__m256i *)(oc + 8), _mm256_permute2x128_si256(d, e, 0x20));
            _mm256_storeu_si256((__m256i *)(oc + 16), _mm256_permute2x128_si256(a, b2, 0x31));
            _mm256_storeu_si256((__m256i *)(oc + 24), _mm256_permute2x128_si256(d, e, 0x31));
        }
    }
    return 1;
}

/* Rows o .. o + nr - 1 (nr 1..K3_PR) for tokens 0..nt-1 (two or more; one token takes
 * k3avx2_one512.c) of a widened block (xd: nt x cp float64, natural order): lane-pass tiles
 * where four rows and five tokens are there (bf16 and MXFP4); the MXFP4 tokens left over in
 * even groups of at most MX_NT, each row alone (two rows a pass for up to two tokens); else
 * K3_NT tokens and up to K3_NR rows per pass over the rows.
 *
 * The MXFP4 groups: two rows of three tokens (K3_NR x K3_NT) hold 24 accumulators and eight
 * decoded weight registers, more than the 32 zmm registers, and a row's lane-pass step
 * reloads its scale's table for every eight columns; one row of up to four tokens keeps
 * 16 accumulators and decodes each group once. The routed experts of a batched step have
 * two to seven rows each. Two Zen 4 threads, best of five over 100-odd matrices streamed
 * from memory, GMAC/s before -> after for [1344 x 768] / [768 x 672]: 3 tokens 17.8 -> 27.8
 * / 18.5 -> 24.6, 4 tokens 16.4 -> 24.7 / 15.1 -> 21.9, 6 tokens 23.8 -> 26.5 / 22.4 ->
 * 28.6; 2 tokens as before (two rows a pass). On bf16 the one-row groups measured slower
 * (a row's pass streams it from memory alone), so bf16 keeps the two-row passes. */
K3_INLINE512 void k3__row512(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                             int64_t nr, int64_t rows, int64_t cols, int64_t cp,
                             const double *xd, int64_t nt, float *y) {
    int64_t t = 0;
    if (nr == K3_PR && kind != K3_W_F32)
        for (; t + K3_PT <= nt; t += K3_PT)
            pass_tile(kind, K3_PT, w, sc, o, cols, cp, xd + t * cp, rows, y + t * rows);
    if (kind == K3_W_MXFP4 && t < nt) {
        const int64_t left = nt - t, groups = (left + MX_NT - 1) / MX_NT;
        for (int64_t i = 0, tt = t; i < groups; ++i) {
            const int64_t m = left / groups + (i < left % groups);
            const double *xt = xd + tt * cp;
            for (int64_t r = 0; r < nr;) {
                float *yt = y + tt * rows + o + r;
                const int two = m <= 2 && r + 1 < nr; /* two rows a pass for up to two tokens */
                if (two && m == 1) rows_tokens(kind, 2, 1, w, sc, o + r, cols, cp, xt, rows, yt);
                else if (two) rows_tokens(kind, 2, 2, w, sc, o + r, cols, cp, xt, rows, yt);
                else if (m == 1) rows_tokens(kind, 1, 1, w, sc, o + r, cols, cp, xt, rows, yt);
                else if (m == 2) rows_tokens(kind, 1, 2, w, sc, o + r, cols, cp, xt, rows, yt);
                else if (m == 3) rows_tokens(kind, 1, 3, w, sc, o + r, cols, cp, xt, rows, yt);
                else rows_tokens(kind, 1, 4, w, sc, o + r, cols, cp, xt, rows, yt);
                r += two ? 2 : 1;
            }
            tt += m;
        }
        return;
    }
    for (int64_t r0 = 0; r0 < nr; r0 += K3_NR) {
        const int64_t pr = nr - r0 < K3_NR ? nr - r0 : K3_NR;
        for (int64_t tt = t; tt < nt;) {
            const int64_t left = nt - tt;
            const int64_t n = left < K3_NT ? left : K3_NT;
            const double *xt = xd + tt * cp;
            float *yt = y + tt * rows + o + r0;
#define K3_RT(R, N) rows_tokens(kind, R, (N) <= K3_NT ? (N) : 1, w, sc, o + r0, cols, cp, xt, rows, yt)
#define K3_RN(R)                                                                               \
    switch (n) {                                                                               \
    case 1: K3_RT(R, 1); break;                                                                \
    case 2: K3_RT(R, 2); break;                                                                \
    default: K3_RT(R, 3); break;                                                               \
    }
            if (pr == 1) {
                K3_RN(1)
            } else {
                K3_RN(2)
            }
#undef K3_RN
#undef K3_RT
            tt += n;
        }
    }
}

/* The three weight kinds as separate functions, so each inner loop is specialised. */
K3_AVX512 static void k3__row512_bf16(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                                  int64_t rows, int64_t cols, int64_t cp, const double *xd,
                                  int64_t nt, float *y) {
    k3__row512(K3_W_BF16, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
K3_AVX512 static void k3__row512_f32(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                                  int64_t rows, int64_t cols, int64_t cp, const double *xd,
                                  int64_t nt, float *y) {
    k3__row512(K3_W_F32, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
K3_AVX512 static void k3__row512_mxfp4(const void *w, const uint8_t *sc, int64_t o, int64_t nr,
                                  int64_t rows, int64_t cols, int64_t cp, const double *xd,
                                  int64_t nt, float *y) {
    k3__row512(K3_W_MXFP4, w, sc, o, nr, rows, cols, cp, xd, nt, y);
}
