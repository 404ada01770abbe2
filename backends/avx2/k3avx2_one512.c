/* k3avx2_one512.c - one token on AVX-512: the matrix-vector product (k3avx2_matmul.c's
 * K3_PATH_ONE), every weight kind, in tiles of ONE_TILE rows.
 *
 * A row is dec_chunk's 32-column chunks in natural order, four zmm lane registers, each lane
 * adding its terms in increasing column order from +0.0, and fold512's fold: the bits of
 * the lane-pass and span tiles, token by token (rows_tokens with one row and one token).
 *
 * Wide rows. Each chunk of weights meets 32 float64 activations, 256 bytes for 64 of bf16:
 * once a row's activations outgrow L1 (cp > ONE_WIDE, 32 KiB of float64), every weight line
 * streamed from memory costs four lines from L2 as well, and the stream stalls. Measured on
 * a Zen 5 core, one thread, bf16 [12288 x 7168] from DRAM: 16-17 GB/s whatever the
 * prefetch distance, against 30-32 GB/s for [43008 x 2048], whose activations stay in L1.
 * So a tile's rows go block by block: for each block of at most ONE_BLOCK columns, every
 * row of the tile continues its four lane registers (kept in the tile's accumulators
 * between blocks) over that block's chunks, the block's 16 KiB of activations staying in
 * L1. Every lane still adds its terms in increasing column order, so the bits are those of
 * the row done in one go. Measured the same way: [12288 x 7168] at 30 GB/s, tiles of 16
 * rows (8 rows: 25-26, 32: 26-29).
 *
 * Prefetch. The rows of a tile are not read in address order, so the weights are fetched
 * into L2 by hand (prefetch_at): while a row's block b is multiplied, its block b + 1 is prefetched line
 * by line, and during the last block the first block of the row ONE_TILE further on (the
 * next tile of the same job, when the job has one). The first block of a job's first tile
 * is left to the hardware prefetchers, so the pool hands these rows out in chunks of
 * ONE_CHUNK_TILES tiles at least (k3avx2_matmul.c's row_chunk). Rows that fit L1 go
 * through rows_tokens as before (one prefetched stream per row).
 *
 * bf16 rows unpacked. Widening a chunk of 32 bf16 weights to four zmm of float64 takes two
 * zero-extensions to 32 bits and two shifts (512-bit shuffle and shift work) ahead of the
 * four conversions to float64, and on Zen 4 that work, not the FMAs, set the pace: about
 * 12.5 cycles a chunk in L1. Interleaving each 128-bit lane's words with zeros (a 256-bit
 * vpunpcklwd / vpunpckhwd) gives the float32 weights in one step each, in the order
 * [0-3, 8-11], [4-7, 12-15], [16-19, 24-27], [20-23, 28-31] of the chunk's columns:
 * 14.3 against 9.8 G weights/s in a standalone loop (one Zen 4 core, rows in L1). So a
 * bf16 row's lane registers hold those columns (the activations are widened in the same
 * order, k3avx2_matmul.c's K3_X_BF16U: bits 2 and 3 of a column swapped), each lane still
 * adding its contract lane's terms in increasing column order, and fold512u folds them with
 * exactly fold512's additions (lane i with lane i + 16, then + 8, + 4, + 2, + 1).
 */
#include "k3avx2_internal.h"

#define ONE_TILE 16        /* rows per tile */
#define ONE_WIDE 4096      /* padded columns above which a tile goes block by block */
#define ONE_BLOCK 2048     /* columns per block at most: 16 KiB of float64 activations */
#define ONE_CHUNK_TILES 4  /* tiles per chunk of the pool on wide rows (row_chunk) */

/* Chunk c of bf16 row o in the unpacked order (above), a column tail completed with +0.0. */
K3_INLINE512 void dec_bf16u(__m512d q[4], const uint16_t *w, int64_t o, int64_t cols,
                            int64_t c) {
    const uint16_t *r = w + o * cols + 32 * c;
    uint16_t tail[32];
    if (32 * c + 32 > cols) {
        memset(tail, 0, sizeof tail);
        memcpy(tail, r, (size_t)(cols - 32 * c) * sizeof(uint16_t));
        r = tail;
    }
    const __m256i z = _mm256_setzero_si256();
    const __m256i lo = _mm256_loadu_si256((const __m256i *)r);
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(r + 16));
    q[0] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, lo)));
    q[1] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, lo)));
    q[2] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, hi)));
    q[3] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, hi)));
}

/* fold512 of lane registers in the unpacked order: a0 holds lanes 0-3 and 8-11, a1 4-7 and
 * 12-15, a2 16-19 and 24-27, a3 20-23 and 28-31. h = 16 is a0 + a2 and a1 + a3, h = 8 each
 * sum's halves, which leaves lanes 0-3 and 4-7 in order: the rest is fold512's. */
K3_INLINE512 double fold512u(__m512d a0, __m512d a1, __m512d a2, __m512d a3) {
    const __m512d s = _mm512_add_pd(a0, a2), t = _mm512_add_pd(a1, a3);
    const __m256d c = _mm256_add_pd(_mm512_castpd512_pd256(s), _mm512_extractf64x4_pd(s, 1));
    const __m256d d = _mm256_add_pd(_mm512_castpd512_pd256(t), _mm512_extractf64x4_pd(t, 1));
    double v[4];
    _mm256_storeu_pd(v, _mm256_add_pd(c, d));
    const double s0 = v[0] + v[2], s1 = v[1] + v[3];
    return s0 + s1;
}

/* Chunk c of row o: dec_chunk's weights, bf16 in the unpacked order. */
K3_INLINE512 void dec_one(enum k3_wkind kind, __m512d q[4], const void *w, const uint8_t *sc,
                          int64_t o, int64_t cols, int64_t c) {
    if (kind == K3_W_BF16)
        dec_bf16u(q, (const uint16_t *)w, o, cols, c);
    else
        dec_chunk(kind, q, w, sc, o, cols, c);
}

/* A row's lane registers folded: fold512u for bf16's unpacked order, else fold512. */
K3_INLINE512 double fold_one(enum k3_wkind kind, const __m512d a[4]) {
    return kind == K3_W_BF16 ? fold512u(a[0], a[1], a[2], a[3]) : fold512(a[0], a[1], a[2], a[3]);
}

/* Chunks [c0, c1) of row o added to its lane registers a; chunk c0 + i of row `pr` is
 * prefetched from chunk pc0 on (pr < 0: none). */
K3_INLINE512 void one_block(enum k3_wkind kind, __m512d a[4], const void *w, const uint8_t *sc,
                            int64_t o, int64_t cols, const double *xd, int64_t c0, int64_t c1,
                            int64_t pr, int64_t pc0) {
    __m512d a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    for (int64_t c = c0; c < c1; ++c) {
        if (pr >= 0) prefetch_at(kind, w, sc, pr, cols, pc0 + (c - c0));
        __m512d q[4];
        dec_one(kind, q, w, sc, o, cols, c);
        const double *xc = xd + 32 * c;
        a0 = _mm512_fmadd_pd(q[0], _mm512_loadu_pd(xc), a0);
        a1 = _mm512_fmadd_pd(q[1], _mm512_loadu_pd(xc + 8), a1);
        a2 = _mm512_fmadd_pd(q[2], _mm512_loadu_pd(xc + 16), a2);
        a3 = _mm512_fmadd_pd(q[3], _mm512_loadu_pd(xc + 24), a3);
    }
    a[0] = a0;
    a[1] = a1;
    a[2] = a2;
    a[3] = a3;
}

/* Rows o .. o + nr - 1 (nr <= ONE_TILE) for one token (xd: cp float64 columns, natural
 * order; y[o + r]); `ahead` rows after the tile belong to the same job and matrix (their
 * first block is prefetched during this tile's last). */
K3_INLINE512 void k3__one512(enum k3_wkind kind, const void *w, const uint8_t *sc, int64_t o,
                             int64_t nr, int64_t cols, int64_t cp, const double *xd, float *y,
                             int64_t ahead) {
    if (cp <= ONE_WIDE) {
        for (int64_t r = 0; r < nr; ++r) {
            if (kind != K3_W_BF16) {
                rows_tokens(kind, 1, 1, w, sc, o + r, cols, cp, xd, 0, y + o + r);
                continue;
            }
            __m512d a[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                            _mm512_setzero_pd()};
            /* one stream, prefetched PREFETCH512_BF16 bytes ahead (into the next rows) */
            one_block(kind, a, w, sc, o + r, cols, xd, 0, cp / 32, o + r, PREFETCH512_BF16 / 64);
            y[o + r] = (float)fold_one(kind, a);
        }
        return;
    }
    const int64_t chunks = cp / 32;
    const int64_t nb = (chunks + ONE_BLOCK / 32 - 1) / (ONE_BLOCK / 32);
    const int64_t bc = (chunks + nb - 1) / nb; /* chunks per block: blocks of equal length */
    __m512d acc[ONE_TILE][4];
    for (int64_t r = 0; r < nr; ++r)
        for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_pd();
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t c0 = b * bc, c1 = c0 + bc < chunks ? c0 + bc : chunks;
        for (int64_t r = 0; r < nr; ++r) {
            int64_t pr = -1, pc0 = 0;
            if (b + 1 < nb) {
                pr = o + r;
                pc0 = c1;
            } else if (r < ahead) {
                pr = o + nr + r;
            }
            one_block(kind, acc[r], w, sc, o + r, cols, xd, c0, c1, pr, pc0);
        }
    }
    for (int64_t r = 0; r < nr; ++r) y[o + r] = (float)fold_one(kind, acc[r]);
}

/* The three weight kinds as separate functions, so each inner loop is specialised. */
#define K3_ONE_FN(name, KIND)                                                                  \
    K3_AVX512 static void name(const void *w, const uint8_t *sc, int64_t o, int64_t nr,        \
                               int64_t cols, int64_t cp, const double *xd, float *y,           \
                               int64_t ahead) {                                                \
        k3__one512(KIND, w, sc, o, nr, cols, cp, xd, y, ahead);                                \
    }
K3_ONE_FN(k3__one512_bf16, K3_W_BF16)
K3_ONE_FN(k3__one512_f32, K3_W_F32)
K3_ONE_FN(k3__one512_mxfp4, K3_W_MXFP4)
#undef K3_ONE_FN
