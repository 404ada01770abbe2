/* The bp-bits decoder's interface (cffi reads this file as its cdef: plain declarations only). */
#define K3BITS_E_ODD 1
#define K3BITS_E_SHORT 2
#define K3BITS_E_WIDTH 3
#define K3BITS_E_TABLE 4
#define K3BITS_E_COUNT 5
#define K3BITS_E_LENGTH 6
#define K3BITS_E_PADDING 7
#define K3BITS_E_ESCAPES 8

/* the widest join this CPU runs: 2 AVX-512 (BW and VBMI2), 1 AVX2, 0 the portable loop */
int k3bits_vector(void);
/* decode one window of src_len bytes into out_len bytes with a join no wider than `vector`;
 * 0, or one of K3BITS_E_* */
int k3bits_decode(const uint8_t *src, size_t src_len, uint8_t *out, size_t out_len, int vector);
