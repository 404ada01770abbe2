/* The bp-bits trunk codec's decoder (k3core/trunk/bitcode.py describes the format).
 *
 * A window of m little-endian 16-bit elements is stored as
 *   u8 b        the code width, 2, 3 or 4 bits; then three reserved zero bytes
 *   u32 E       how many elements are escapes (little-endian)
 *   table[16]   the high byte of codes 0 .. 2^b - 2; the entries from 2^b - 1 on are 0
 *   codes       ceil(m / 64) groups of b little-endian u64 planes: bit j of a group's
 *               plane p is bit p of element 64 g + j's code; bits past m are 0
 *   lo          m bytes: every element's low byte, verbatim
 *   esc         E bytes: the escapes' high bytes, in element order
 * and an escape's code is 2^b - 1 (all its bits set). Decoding never reads or writes
 * outside the two buffers it is given, whatever the bytes: every length is checked first,
 * and no escape byte is read before the count of escape codes met so far is checked against
 * E; a window that fails a check returns its K3BITS_E_* code with nothing promised about
 * `out`.
 *
 * Three joins write the same bytes: AVX-512 (BW for the byte masks, VBMI2 for the expand
 * that drops the escapes' bytes into their places) 64 elements a step, AVX2 32 a step with
 * the rare escapes patched one by one, and a portable loop, which also takes the last,
 * partial group.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bitcode.h"

#define HEADER 24u
#define GROUP 64u

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t le64(const uint8_t *p) {
    return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32);
}

/* What every join shares: the window's parts and how many escape bytes were taken. */
typedef struct {
    const uint8_t *codes, *lo, *esc, *table;
    uint8_t *out;
    size_t m, e, taken;
    unsigned b;
} window_t;

/* Elements [64 g, 64 g + count) one by one; 0, or K3BITS_E_ESCAPES when the codes name more
 * escapes than E. */
static int join_group_portable(window_t *w, size_t g, size_t count) {
    uint64_t plane[4];
    const unsigned escape = (1u << w->b) - 1u;
    for (unsigned p = 0; p < w->b; p++) plane[p] = le64(w->codes + 8u * (w->b * g + p));
    const size_t i0 = GROUP * g;
    for (size_t j = 0; j < count; j++) {
        unsigned code = 0;
        for (unsigned p = 0; p < w->b; p++) code |= (unsigned)((plane[p] >> j) & 1u) << p;
        uint8_t hi;
        if (code == escape) {
            if (w->taken == w->e) return K3BITS_E_ESCAPES;
            hi = w->esc[w->taken++];
        } else {
            hi = w->table[code];
        }
        w->out[2u * (i0 + j)] = w->lo[i0 + j];
        w->out[2u * (i0 + j) + 1u] = hi;
    }
    return 0;
}

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define K3BITS_X86 1

/* 32 bits as 32 bytes, 0xff where the bit is set (byte j from bit j). */
__attribute__((target("avx2"))) static inline __m256i spread32(uint32_t bits) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* Whole groups, 32 elements a step; returns 0 or K3BITS_E_ESCAPES. */
__attribute__((target("avx2,bmi"))) static int join_avx2(window_t *w, size_t groups) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->table));
    const unsigned b = w->b;
    for (size_t g = 0; g < groups; g++) {
        uint64_t plane[4];
        for (unsigned p = 0; p < b; p++) memcpy(&plane[p], w->codes + 8u * (b * g + p), 8);
        for (unsigned h = 0; h < 2; h++) {
            const size_t i = GROUP * g + 32u * h;
            __m256i code = _mm256_setzero_si256();
            uint32_t escapes = ~0u;
            for (unsigned p = 0; p < b; p++) {
                const uint32_t bits = (uint32_t)(plane[p] >> (32u * h));
                escapes &= bits;
                code = _mm256_or_si256(code, _mm256_and_si256(spread32(bits),
                                                              _mm256_set1_epi8((char)(1 << p))));
            }
            __m256i hi = _mm256_shuffle_epi8(table, code);
            if (escapes) {
                uint8_t tmp[32];
                _mm256_storeu_si256((__m256i *)tmp, hi);
                do {
                    if (w->taken == w->e) return K3BITS_E_ESCAPES;
                    tmp[_tzcnt_u32(escapes)] = w->esc[w->taken++];
                    escapes &= escapes - 1u;
                } while (escapes);
                hi = _mm256_loadu_si256((const __m256i *)tmp);
            }
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(w->lo + i));
            const __m256i a = _mm256_unpacklo_epi8(lo, hi); /* elements 0-7 | 16-23 */
            const __m256i c = _mm256_unpackhi_epi8(lo, hi); /* elements 8-15 | 24-31 */
            _mm256_storeu_si256((__m256i *)(w->out + 2u * i), _mm256_permute2x128_si256(a, c, 0x20));
            _mm256_storeu_si256((__m256i *)(w->out + 2u * i + 32u),
                                _mm256_permute2x128_si256(a, c, 0x31));
        }
    }
    return 0;
}

/* Whole groups, 64 elements a step: the planes are the byte masks themselves, and one expand
 * load drops the group's escape bytes into their places. Returns 0 or K3BITS_E_ESCAPES. */
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt"))) static int join_avx512(window_t *w,
                                                                                   size_t groups) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)w->table));
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    const unsigned b = w->b;
    for (size_t g = 0; g < groups; g++) {
        const uint8_t *planes = w->codes + 8u * b * g;
        uint64_t bits;
        memcpy(&bits, planes, 8);
        __mmask64 escapes = _cvtu64_mask64(bits);
        __m512i code = _mm512_maskz_mov_epi8(escapes, _mm512_set1_epi8(1));
        for (unsigned p = 1; p < b; p++) {
            memcpy(&bits, planes + 8u * p, 8);
            const __mmask64 k = _cvtu64_mask64(bits);
            escapes = _kand_mask64(escapes, k);
            code = _mm512_mask_add_epi8(code, k, code, _mm512_set1_epi8((char)(1 << p)));
        }
        __m512i hi = _mm512_shuffle_epi8(table, code);
        const uint64_t e = _cvtmask64_u64(escapes);
        if (e) {
            const size_t count = (size_t)__builtin_popcountll(e);
            if (count > w->e - w->taken) return K3BITS_E_ESCAPES;
            hi = _mm512_mask_expandloadu_epi8(hi, escapes, w->esc + w->taken);
            w->taken += count;
        }
        const size_t i = GROUP * g;
        const __m512i lo = _mm512_loadu_si512((const void *)(w->lo + i));
        const __m512i a = _mm512_unpacklo_epi8(lo, hi);
        const __m512i c = _mm512_unpackhi_epi8(lo, hi);
        _mm512_storeu_si512((void *)(w->out + 2u * i), _mm512_permutex2var_epi64(a, first, c));
        _mm512_storeu_si512((void *)(w->out + 2u * i + 64u), _mm512_permutex2var_epi64(a, second, c));
    }
    return 0;
}
#endif

int k3bits_vector(void) {
#ifdef K3BITS_X86
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("popcnt"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi")) return 1;
#endif
    return 0;
}

/* The widest join this CPU runs, found once when the module loads (before any thread can
 * decode), so that a join the CPU lacks is never run, whatever the caller asks. */
static int g_best = 0;
#ifdef K3BITS_X86
__attribute__((constructor)) static void k3bits__pick(void) { g_best = k3bits_vector(); }
#endif

int k3bits_decode(const uint8_t *src, size_t src_len, uint8_t *out, size_t out_len, int vector) {
    if (vector > g_best) vector = g_best;
    if (out_len == 0 || out_len % 2u != 0) return K3BITS_E_ODD;
    if (src_len < HEADER) return K3BITS_E_SHORT;
    const unsigned b = src[0];
    if (b < 2u || b > 4u || src[1] || src[2] || src[3]) return K3BITS_E_WIDTH;
    const uint8_t *table = src + 8;
    for (unsigned c = (1u << b) - 1u; c < 16u; c++)
        if (table[c]) return K3BITS_E_TABLE;
    const size_t m = out_len / 2u;
    const size_t e = le32(src + 4);
    if (e > m) return K3BITS_E_COUNT;
    const size_t groups = (m + GROUP - 1u) / GROUP;
    /* no overflow: m < SIZE_MAX / 4, the codes take at most m / 2 + 32 bytes and e <= m */
    const size_t codes_len = 8u * b * groups;
    if (src_len != HEADER + codes_len + m + e) return K3BITS_E_LENGTH;
    window_t w = {src + HEADER, src + HEADER + codes_len, src + HEADER + codes_len + m, table,
                  out, m, e, 0, b};
    const size_t rest = m - GROUP * (groups - 1u); /* elements in the last group, 1..64 */
    if (rest < GROUP) {
        const uint64_t unused = ~0ULL << rest;
        for (unsigned p = 0; p < b; p++)
            if (le64(w.codes + 8u * (b * (groups - 1u) + p)) & unused) return K3BITS_E_PADDING;
    }

    const size_t whole = m / GROUP;
    size_t g = 0;
    int err = 0;
#ifdef K3BITS_X86
    if (vector >= 2) {
        err = join_avx512(&w, whole);
        g = whole;
    } else if (vector == 1) {
        err = join_avx2(&w, whole);
        g = whole;
    }
#else
    (void)vector;
#endif
    for (; !err && g < groups; g++) err = join_group_portable(&w, g, g < whole ? GROUP : rest);
    if (err) return err;
    return w.taken == e ? 0 : K3BITS_E_ESCAPES;
}
