/* The bp-nib trunk codec's decoder (k3core/trunk/nibble.py describes the format).
 *
 * A window of m little-endian 16-bit elements is stored as
 *   table[16]  the high byte of codes 0..14; table[15] is reserved and must be 0
 *   u32 E      how many elements are escapes (little-endian)
 *   nib        ceil(m / 2) bytes: element i's 4-bit code, the low nibble for even i
 *   lo         m bytes: every element's low byte, verbatim
 *   idx        E x u32: the escapes' element indices, strictly ascending, each < m
 *   hi         E bytes: the escapes' high bytes
 * and an escape's code is 15. Decoding never reads or writes outside the two buffers it is
 * given, whatever the bytes: every length and index is checked first, and a window that
 * fails a check returns its K3NIB_E_* code with nothing promised about `out`.
 *
 * The join (a 16-entry table lookup per element, then interleaving with the low bytes) is
 * one SSSE3 byte shuffle per 16 elements where the CPU has it, else a portable loop; both
 * write the same bytes.
 */
#include <stddef.h>
#include <stdint.h>

#include "nibble.h"

#define HEADER 20u

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Two elements per code byte: a 256-entry table of both high bytes, then one 4-byte store. */
static size_t join_portable(const uint8_t *nib, const uint8_t *lo, size_t m, const uint8_t *table,
                            uint8_t *out, size_t i) {
    if (i % 2u == 0 && m - i >= 64) {
        uint16_t pair[256];
        for (unsigned c = 0; c < 256; c++)
            pair[c] = (uint16_t)(table[c & 15u] | ((unsigned)table[c >> 4] << 8));
        for (; i + 2 <= m; i += 2) {
            const unsigned p = pair[nib[i / 2]];
            out[2 * i] = lo[i];
            out[2 * i + 1] = (uint8_t)(p & 0xffu);
            out[2 * i + 2] = lo[i + 1];
            out[2 * i + 3] = (uint8_t)(p >> 8);
        }
    }
    for (; i < m; i++) {
        out[2 * i] = lo[i];
        out[2 * i + 1] = table[(nib[i / 2] >> ((i & 1u) * 4u)) & 15u];
    }
    return i;
}

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define K3NIB_SSSE3 1

/* 32 elements a step: 16 code bytes become 32 codes, two shuffles look them up, and four
 * unpacks interleave them with the low bytes. Returns how many elements it joined. */
__attribute__((target("ssse3"))) static size_t join_ssse3(const uint8_t *nib, const uint8_t *lo,
                                                           size_t m, const uint8_t *table,
                                                           uint8_t *out) {
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    size_t i = 0;
    for (; i + 32 <= m; i += 32) {
        __m128i v = _mm_loadu_si128((const __m128i *)(nib + i / 2));
        __m128i c0 = _mm_and_si128(v, low4);
        __m128i c1 = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        __m128i h0 = _mm_shuffle_epi8(t, _mm_unpacklo_epi8(c0, c1));
        __m128i h1 = _mm_shuffle_epi8(t, _mm_unpackhi_epi8(c0, c1));
        __m128i l0 = _mm_loadu_si128((const __m128i *)(lo + i));
        __m128i l1 = _mm_loadu_si128((const __m128i *)(lo + i + 16));
        _mm_storeu_si128((__m128i *)(out + 2 * i), _mm_unpacklo_epi8(l0, h0));
        _mm_storeu_si128((__m128i *)(out + 2 * i + 16), _mm_unpackhi_epi8(l0, h0));
        _mm_storeu_si128((__m128i *)(out + 2 * i + 32), _mm_unpacklo_epi8(l1, h1));
        _mm_storeu_si128((__m128i *)(out + 2 * i + 48), _mm_unpackhi_epi8(l1, h1));
    }
    return i;
}
#endif

int k3nib_vector(void) {
#ifdef K3NIB_SSSE3
    return __builtin_cpu_supports("ssse3") ? 1 : 0;
#else
    return 0;
#endif
}

int k3nib_decode(const uint8_t *src, size_t src_len, uint8_t *out, size_t out_len, int vector) {
    if (out_len == 0 || out_len % 2u != 0) return K3NIB_E_ODD;
    if (src_len < HEADER) return K3NIB_E_SHORT;
    const uint8_t *table = src;
    if (table[15] != 0) return K3NIB_E_TABLE;
    const size_t m = out_len / 2u;
    const size_t e = le32(src + 16);
    if (e > m) return K3NIB_E_COUNT;
    const size_t nib_len = (m + 1u) / 2u;
    /* no overflow: m < SIZE_MAX / 2 and e <= m */
    if (src_len != HEADER + nib_len + m + 5u * e) return K3NIB_E_LENGTH;
    const uint8_t *nib = src + HEADER;
    const uint8_t *lo = nib + nib_len;
    const uint8_t *idx = lo + m;
    const uint8_t *hi = idx + 4u * e;

    size_t i = 0;
#ifdef K3NIB_SSSE3
    if (vector) i = join_ssse3(nib, lo, m, table, out);
#else
    (void)vector;
#endif
    join_portable(nib, lo, m, table, out, i);

    size_t prev = 0;
    for (size_t k = 0; k < e; k++) {
        const size_t j = le32(idx + 4u * k);
        if (j >= m || (k > 0 && j <= prev)) return K3NIB_E_INDEX;
        if (((nib[j / 2] >> ((j & 1u) * 4u)) & 15u) != 15u) return K3NIB_E_CODE;
        out[2 * j + 1] = hi[k];
        prev = j;
    }
    return 0;
}
