/* k3avx2.h - the public C interface of the avx2 kernel backend (k3_backends._k3avx2).
 *
 * Every function implements one operation of the bit-exact kernel contract in
 * k3core/api/kernels.py; the numeric constants come from k3core/api/contract.py through the
 * header the build script generates (backends/avx2_build.py). Arrays are C-contiguous;
 * the caller (backends/avx2_backend.py) validates shapes and allocates outputs.
 *
 * This file is also the cffi cdef: plain declarations only (no macros, no includes).
 * Functions returning int return 0 on success, -1 when scratch memory could not be
 * allocated and -2 for arguments the caller should have refused (MXFP4 width not a
 * multiple of 32).
 */

/* ---- runtime ------------------------------------------------------------------ */
void k3_set_threads(int n);
void k3_set_force_parallel(int on);
long long k3_parallel_regions(void);
int k3_has_avx512(void);
int k3_use_avx512(int on);
int k3_use_span_f32(int on);
int k3_contract_values(double *out, int cap);
int k3_gil_rendezvous(int parties, double timeout_s);
double k3_read_bandwidth(const uint8_t *buf, size_t nbytes, int repeat, uint64_t *checksum);
double k3_fma_peak(int64_t iters, int repeat, double *sink);
double k3_decode_peak(int64_t iters, int repeat, int64_t *weights, double *sink);

/* ---- matrix products: y[t, o] = f32(lsum_i W[o, i] * x[t, i]) ------------------------ */
int k3_matmul_bf16(const uint16_t *w, int64_t rows, int64_t cols,
                   const float *x, int64_t T, float *y);
int k3_matmul_f32(const float *w, int64_t rows, int64_t cols,
                  const float *x, int64_t T, float *y);
int k3_matmul_mxfp4(const uint8_t *packed, const uint8_t *scales, int64_t rows, int64_t cols,
                    const float *x, int64_t T, float *y);
/* n (1..16) matrices of one kind (0 bf16, 1 f32, 2 MXFP4; scales NULL unless MXFP4) over the
 * same x[T, cols], in one parallel region: y[i][t, o] as k3_matmul_* would give. */
int k3_matmul_many(int kind, int n, void **w, uint8_t **scales, const int64_t *rows, int64_t cols,
                   const float *x, int64_t T, float **y);
/* y[T, out_rows] = W2 . situ_glu(W1 . x, W3 . x, b1, b2) (W1, W3: [inter, cols]; W2:
 * [out_rows, inter]), exactly the separate calls' bits, in one parallel region. */
int k3_situ_mlp(int kind, const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3,
                const void *w2, const uint8_t *s2, int64_t inter, int64_t cols, int64_t out_rows,
                const float *x, int64_t T, double b1, double b2, float *y);
/* n SiTU MLPs of one kind and shape (the routed experts of a layer), each over its own
 * x[i][T[i], cols] into y[i][T[i], out_rows]: exactly n k3_situ_mlp calls' bits, in one call
 * (three parallel regions in all). Scales arrays are NULL unless MXFP4. */
int k3_situ_mlp_many(int kind, int n, void **w1, uint8_t **s1, void **w3, uint8_t **s3,
                     void **w2, uint8_t **s2, int64_t inter, int64_t cols, int64_t out_rows,
                     const float **x, const int64_t *T, double b1, double b2, float **y);

/* ---- normalisation and activations (x viewed as [rows, m] or flat [n]) ------------- */
void k3_rmsnorm(const float *x, int64_t rows, int64_t m, const float *w, double eps, float *y);
void k3_l2norm(const float *x, int64_t rows, int64_t m, float *y);
void k3_sigmoid(const float *x, int64_t n, float *y);
void k3_silu(const float *x, int64_t n, float *y);
void k3_exp(const float *x, int64_t n, float *y);
void k3_situ_glu(const float *g, const float *u, int64_t n, double b1, double b2, float *y);

/* ---- attention building blocks ----------------------------------------------------- */
void k3_shortconv(const float *x, int64_t T, int64_t C, const float *w, int64_t K,
                  float *hist, float *y);
void k3_kda_gate(const float *z, int64_t T, int64_t H, int64_t D, const float *dt_bias,
                 const float *a_log, double lower_bound, float *y);
int k3_kda_recurrent(const float *q, const float *k, const float *v, const float *alpha,
                     const float *beta, int64_t T, int64_t H, int64_t Dk, int64_t Dv,
                     float *state, float *out);
int k3_mla_attention(const float *q, const float *k_nope, const float *k_rope, const float *v,
                     int64_t T, int64_t H, int64_t n, int64_t r, int64_t dv, int64_t S,
                     int64_t pos0, double scale, float *out);
/* Absorbed MLA over the latent cache[S, C+r] (rows 0 .. pos0+T-1 read): w is kv_b
 * [H*(n+dv), C] of kind 0 (bf16) or 1 (float32); out[T, H, dv]. */
int k3_mla_latent_attention(const float *q, const float *cache, const void *w, int kind,
                            int64_t T, int64_t H, int64_t n, int64_t C, int64_t r, int64_t dv,
                            int64_t pos0, double scale, float *out);
int k3_attn_res(const float *src, int64_t S, int64_t T, int64_t E, const float *fold,
                double eps, float *out);
int k3_router(const float *logits, int64_t T, int64_t N, const float *bias, int64_t k,
               int64_t kk, int renorm, double scale, int64_t *idx, float *w);

/* ---- fused layer parts: exactly the separate calls' bits, one foreign call ----------- */
/* y[T, E] = rmsnorm(attn_res(src, fold, eps), w, eps) */
int k3_attn_res_norm(const float *src, int64_t S, int64_t T, int64_t E, const float *fold,
                     const float *w, double eps, float *y);
/* A KDA layer's token mixer (k3core/api/kernels.py KernelBackend.kda_mix): every matrix of
 * one kind (0 bf16, 1 f32, 2 MXFP4; scales NULL unless MXFP4). proj: q, k, v [P, E], the
 * beta logits [H, E], the gate's down-projection [R, E], the output gate [P, E] (P = H * D);
 * f_b [P, R]; o_proj [out_rows, P]; conv: q, k, v kernels [P, K]. nseq sequences split the
 * T rows (seq_rows), each with its q/k/v histories [P, K-1] and state [H, D, D], updated
 * in place. y[T, out_rows]. */
int k3_kda_mix(int kind, void **proj, uint8_t **proj_s, const void *f_b, const uint8_t *f_b_s,
               const void *o_proj, const uint8_t *o_proj_s, const float *dt_bias,
               const float *a_log, double lower_bound, const float **conv, int64_t K,
               const float *o_norm, double eps, float q_scale, int64_t E, int64_t H,
               int64_t D, int64_t R, int64_t out_rows, const float *x, int64_t T, int nseq,
               const int64_t *seq_rows, float **hist, float **state, float *y);
/* A LatentMoE block's output (KernelBackend.moe_combine): acc[T, lat] = sum over the k
 * slots of f32(w[t, j] * outs[t, j, :]) from +0.0; rmsnorm(acc, norm, eps) when norm is not
 * NULL; y[T, E] = up . acc (+ shared[T, E] when not NULL). */
int k3_moe_combine(const float *w, const float *outs, int64_t T, int64_t k, int64_t lat,
                   const float *norm, double eps, int kind, const void *up,
                   const uint8_t *up_s, int64_t E, const float *shared, float *y);
/* A LatentMoE block's way in (KernelBackend.moe_route): xn[T, E] = rmsnorm(attn_res(src,
 * fold, eps), norm, eps); logits = gate . xn ([N, E], kind), z[T, lat] = down . xn (same
 * kind); idx[T, kk], w[T, kk] = router(logits, bias, k, renorm, scale). */
int k3_moe_route(const float *src, int64_t S, int64_t T, int64_t E, const float *fold,
                 const float *norm, double eps, int kind, void *gate, uint8_t *gate_s,
                 void *down, uint8_t *down_s, int64_t N, int64_t lat, const float *bias,
                 int64_t k, int64_t kk, int renorm, double scale, float *xn, int64_t *idx,
                 float *w, float *z);
/* A gated MLA layer's attention (KernelBackend.mla_mix): q_a [QL, E], kv_a [C + r, E], gate
 * [H * dv, E] (NULL: none), q_b [H * (n + r), QL], o_proj [out_rows, H * dv], all of `kind`;
 * kv_b bf16 (kv_kind 0) or f32 (1) [H * (n + dv), C]. nseq sequences split the T rows of
 * x: seq_rows, their caches [*, C + r] (rows pos .. pos + rows written), positions before,
 * and the rows that attend (each sequence's last attend[s]); y[sum(attend), out_rows]. */
int k3_mla_mix(int kind, const void *q_a, const uint8_t *q_a_s, const void *kv_a,
               const uint8_t *kv_a_s, const void *gate, const uint8_t *gate_s,
               const float *q_a_norm, const float *kv_a_norm, const void *q_b,
               const uint8_t *q_b_s, const void *kv_b, int kv_kind, const void *o_proj,
               const uint8_t *o_proj_s, int64_t E, int64_t QL, int64_t C, int64_t r,
               int64_t H, int64_t n, int64_t dv, int64_t out_rows, double scale, double eps,
               const float *x, int64_t T, int nseq, const int64_t *seq_rows, float **cache,
               const int64_t *pos, const int64_t *attend, float *y);
