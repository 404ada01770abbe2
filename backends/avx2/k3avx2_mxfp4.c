/* k3avx2_mxfp4.c - MXFP4 weights as float64: the decode tables and the decode of one
 * 32-column group into eight four-lane registers (the one-token rows of k3avx2_matmul.c, the
 * AVX2 span tiles' copies in k3avx2_span256.c), and the fold of lanes kept in that order.
 */
#include "k3avx2_internal.h"

/* ---- MXFP4 decode tables ----------------------------------------------------------------
 * For scale byte b and code c, E2M1[c] * E8M0[b] (exact in float64) has at most 16
 * significant leading bits: sign, 11 exponent bits and one mantissa bit. TLO/THI hold the
 * low/high byte of those 16 bits, so two byte shuffles build the float64 bit pattern. */
static uint8_t TLO[256][16] __attribute__((aligned(16)));
static uint8_t THI[256][16] __attribute__((aligned(16)));
static double WVAL[256][16]; /* the float64 values themselves (scalar fallback) */
static int g_tables_exact = 0;

__attribute__((constructor)) static void k3__mxfp4_tables(void) {
    int exact = 1;
    for (int b = 0; b < 256; ++b)
        for (int c = 0; c < 16; ++c) {
            double v = K3C_E2M1[c] * K3C_E8M0[b];
            uint64_t bits;
            memcpy(&bits, &v, 8);
            if (bits & UINT64_C(0x0000FFFFFFFFFFFF)) exact = 0;
            WVAL[b][c] = v;
            TLO[b][c] = (uint8_t)(bits >> 48);
            THI[b][c] = (uint8_t)(bits >> 56);
        }
    g_tables_exact = exact;
}

/* Order of the columns of one 32-column group inside the 8 accumulator registers of the
 * MXFP4 kernel: register j holds columns 4j + {0, 2, 1, 3}. */
static const int MX_PERM[4] = {0, 2, 1, 3};

/* Decode one MXFP4 group (16 packed bytes, scale byte b) into 8 registers of float64
 * weights in MX_PERM order. */
static inline void decode_group(__m256d q[8], const uint8_t *pk, int b) {
    const __m128i m0f = _mm_set1_epi8(0x0F);
    __m128i p = _mm_loadu_si128((const __m128i *)pk);
    __m128i lo = _mm_and_si128(p, m0f);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(p, 4), m0f);
    __m256i codes = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    __m256i tl = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)TLO[b]));
    __m256i th = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)THI[b]));
    __m256i L = _mm256_shuffle_epi8(tl, codes), H = _mm256_shuffle_epi8(th, codes);
    __m256i w0 = _mm256_unpacklo_epi8(L, H), w1 = _mm256_unpackhi_epi8(L, H);
    const char Z = (char)0x80;
#define SPREAD(j)                                                                              \
    _mm256_setr_epi8(Z, Z, Z, Z, Z, Z, 4 * (j), 4 * (j) + 1, Z, Z, Z, Z, Z, Z, 4 * (j) + 2,     \
                     4 * (j) + 3, Z, Z, Z, Z, Z, Z, 4 * (j), 4 * (j) + 1, Z, Z, Z, Z, Z, Z,    \
                     4 * (j) + 2, 4 * (j) + 3)
    const __m256i s0 = SPREAD(0), s1 = SPREAD(1), s2 = SPREAD(2), s3 = SPREAD(3);
#undef SPREAD
    q[0] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w0, s0));
    q[1] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w0, s1));
    q[2] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w0, s2));
    q[3] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w0, s3));
    q[4] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w1, s0));
    q[5] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w1, s1));
    q[6] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w1, s2));
    q[7] = _mm256_castsi256_pd(_mm256_shuffle_epi8(w1, s3));
}

/* Scalar decode of one group into MX_PERM order (used when the tables are not exact). */
static inline void decode_group_scalar(double *out, const uint8_t *pk, int b) {
    for (int i = 0; i < 32; ++i) {
        int src = (i & ~3) + MX_PERM[i & 3];
        int byte = pk[src >> 1];
        out[i] = WVAL[b][(src & 1) ? byte >> 4 : byte & 15];
    }
}

static inline void add_group(k3_lanes *L, const __m256d q[8], const double *xp) {
    for (int k = 0; k < 8; ++k)
        L->a[k] = _mm256_fmadd_pd(_mm256_loadu_pd(xp + 4 * k), q[k], L->a[k]);
}

/* Fold lanes stored in MX_PERM order: slot s of register j is lane 4j + MX_PERM[s]. The
 * register-level folds (h = 16, 8, 4) pair registers exactly as in natural order; inside
 * the last register slots (0, 1, 2, 3) are lanes (0, 2, 1, 3). */
static inline double fold_mx(const k3_lanes *L) {
    double t[4];
    k3_lanes_fold_regs(L, t);
    double s0 = t[0] + t[1], s1 = t[2] + t[3]; /* lane0 + lane2, lane1 + lane3 */
    return s0 + s1;
}

