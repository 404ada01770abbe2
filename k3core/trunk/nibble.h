/* The bp-nib decoder's interface (cffi reads this file as its cdef: plain declarations only). */
#define K3NIB_E_ODD 1
#define K3NIB_E_SHORT 2
#define K3NIB_E_TABLE 3
#define K3NIB_E_COUNT 4
#define K3NIB_E_LENGTH 5
#define K3NIB_E_INDEX 6
#define K3NIB_E_CODE 7

/* 1 where the shuffle join can run on this CPU, else 0 */
int k3nib_vector(void);
/* decode one window of src_len bytes into out_len bytes; 0, or one of K3NIB_E_* */
int k3nib_decode(const uint8_t *src, size_t src_len, uint8_t *out, size_t out_len, int vector);
