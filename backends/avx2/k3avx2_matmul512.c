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

__attribute__((constructor)) static void k3__wv512_table(void) {
    for (int b = 0; b < 256; ++b)
        for (int c = 0; c < 16; ++c) WV512[b][c] = K3C_E2M1[c] * K3C_E8M0[b];
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

/* Software prefetch into L2, PREFETCH512_AHEAD bytes ahead of the weight stream: one
 * 64-byte line per line of weights (4 MXFP4 groups, 1 bf16 chunk, half a float32 chunk) and
 * one line of MXFP4 scale bytes per 64 groups. Measured on a Zen 4 core, 1 thread, MXFP4
 * [3072 x 3584] from DRAM: 5.9 GB/s without, 6.9-7.2 GB/s with 2-4 KiB ahead. */
#define PREFETCH512_AHEAD 2048
K3_INLINE512 void prefetch_chunk(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                                 int64_t cols, int64_t c) {
    if (kind == K3_W_MXFP4) {
        const char *r = (const char *)w + o * (cols / 2) + 16 * c;
        if ((c & 3) == 0) _mm_prefetch(r + PREFETCH512_AHEAD, _MM_HINT_T1);
        if ((c & 63) == 0) _mm_prefetch((const char *)sc + o * (cols / 32) + c + PREFETCH512_AHEAD / 16, _MM_HINT_T1);
    } else if (kind == K3_W_BF16) {
        _mm_prefetch((const char *)w + 2 * (o * cols + 32 * c) + PREFETCH512_AHEAD, _MM_HINT_T1);
    } else {
        const char *r = (const char *)w + 4 * (o * cols + 32 * c) + PREFETCH512_AHEAD;
        _mm_prefetch(r, _MM_HINT_T1);
        _mm_prefetch(r + 64, _MM_HINT_T1);
    }
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
K3_INLINE512 void rows_tokens(enum k3_wkind kind, const int NR, const int NT, const void *w,
                              const uint8_t *sc, int64_t o, int64_t cols, int64_t cp,
                              const double *xd, int64_t rows, float *y) {
    __m512d acc[K3_NR][K3_NT][4];
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

/* Rows o .. o + nr - 1 (nr 1..K3_NR) for tokens 0..nt-1 of a widened block (xd: nt x cp
 * float64, natural order), K3_NT tokens per pass over the rows. */
K3_INLINE512 void k3__row512(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                             int64_t nr, int64_t rows, int64_t cols, int64_t cp,
                             const double *xd, int64_t nt, float *y) {
    if (nt == 1 && nr > 1) { /* one token: a row at a time streams faster from memory (one
                              * prefetched stream; 2 rows measured 16-18 % against 20 %) */
        for (int64_t r = 0; r < nr; ++r)
            rows_tokens(kind, 1, 1, w, sc, o + r, cols, cp, xd, rows, y + o + r);
        return;
    }
    for (int64_t t = 0; t < nt;) {
        const int64_t left = nt - t;
        const int64_t n = left < K3_NT ? left : K3_NT;
        const double *xt = xd + t * cp;
        float *yt = y + t * rows + o;
#define K3_RT(R, N) rows_tokens(kind, R, (N) <= K3_NT ? (N) : 1, w, sc, o, cols, cp, xt, rows, yt)
#define K3_RN(R)                                                                               \
    switch (n) {                                                                               \
    case 1: K3_RT(R, 1); break;                                                                \
    case 2: K3_RT(R, 2); break;                                                                \
    case 3: K3_RT(R, 3); break;                                                                \
    case 4: K3_RT(R, 4); break;                                                                \
    case 5: K3_RT(R, 5); break;                                                                \
    case 6: K3_RT(R, 6); break;                                                                \
    default: K3_RT(R, 7); break;                                                               \
    }
        switch (nr) {
        case 1: K3_RN(1) break;
        case 2: K3_RN(2 <= K3_NR ? 2 : 1) break;
        case 3: K3_RN(3 <= K3_NR ? 3 : 1) break;
        default: K3_RN(4 <= K3_NR ? 4 : 1) break;
        }
#undef K3_RN
#undef K3_RT
        t += n;
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
