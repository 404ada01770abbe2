/* k3avx2_router.c - router (k3core/api/kernels.py): s = sigmoid(logits); c = s + bias;
 * pick k by repeated maximum of c (ties to the lowest index, NaN never preferred), listed in
 * selection order; w = s[idx]; optional renormalisation; w * f32(scale). */
#include "k3avx2_internal.h"

/* a ranks before b in NumPy's stable argsort of -c: larger first, NaN last. */
static inline int ranks_before(float a, float b) {
    if (isnan(a)) return 0;
    if (isnan(b)) return 1;
    return a > b;
}

typedef struct {
    const float *logits, *bias;
    int64_t N, k, kk;
    int renorm;
    float fscale;
    int64_t *idx;
    float *w;
    atomic_int err;
} router_job;

/* Tokens [t0, t1), with scratch of their own. */
static void router_fn(void *ctx, int64_t t0, int64_t t1) {
    router_job *j = (router_job *)ctx;
    const int64_t N = j->N, k = j->k, kk = j->kk;
    float *s = (float *)k3__alloc((size_t)N * sizeof(float) * 2);
    unsigned char *taken = (unsigned char *)k3__alloc((size_t)N);
    double *wd = (double *)k3__alloc((size_t)(kk > 0 ? kk : 1) * sizeof(double));
    if (s && taken && wd) {
        for (int64_t t = t0; t < t1; ++t) {
            const float *lt = j->logits + t * N;
            int64_t *it = j->idx + t * kk;
            float *wt = j->w + t * kk;
            float *c = s + N;
            for (int64_t i = 0; i < N; ++i) {
                s[i] = (float)k3_sig_d((double)lt[i]);
                c[i] = s[i] + j->bias[i];
                taken[i] = 0;
            }
            for (int64_t q = 0; q < kk; ++q) {
                int64_t best = -1;
                for (int64_t i = 0; i < N; ++i) {
                    if (taken[i]) continue;
                    if (best < 0 || ranks_before(c[i], c[best])) best = i;
                }
                taken[best] = 1;
                it[q] = best;
                wt[q] = s[best];
            }
            if (k > 1 && j->renorm) {
                for (int64_t q = 0; q < kk; ++q) wd[q] = (double)wt[q];
                double total = k3_lsum_d(wd, kk) + K3C_ROUTER_EPS;
                for (int64_t q = 0; q < kk; ++q) wt[q] = (float)(wd[q] / total);
            }
            for (int64_t q = 0; q < kk; ++q) wt[q] = wt[q] * j->fscale;
        }
    } else {
        atomic_store(&j->err, 1);
    }
    k3__free(s);
    k3__free(taken);
    k3__free(wd);
}

/* kk = min(k, N) columns are selected; `k` itself decides whether to renormalise. */
int k3_router(const float *logits, int64_t T, int64_t N, const float *bias, int64_t k,
              int64_t kk, int renorm, double scale, int64_t *idx, float *w) {
    router_job j = {logits, bias, N, k, kk, renorm, (float)scale, idx, w, 0};
    k3__pool_for(K3_BIG(T * N, K3_PAR_ELEMENTS), router_fn, &j, T, k3__even_chunk(T));
    return atomic_load(&j.err) ? K3_ENOMEM : 0;
}
