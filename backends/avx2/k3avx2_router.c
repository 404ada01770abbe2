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

/* kk = min(k, N) columns are selected; `k` itself decides whether to renormalise. */
int k3_router(const float *logits, int64_t T, int64_t N, const float *bias, int64_t k,
              int64_t kk, int renorm, double scale, int64_t *idx, float *w) {
    const float fscale = (float)scale;
    int err = 0;
#pragma omp parallel num_threads(k3__threads()) if (K3_BIG(T * N, K3_PAR_ELEMENTS))
    {
        float *s = (float *)k3__alloc((size_t)N * sizeof(float) * 2);
        unsigned char *taken = (unsigned char *)k3__alloc((size_t)N);
        double *wd = (double *)k3__alloc((size_t)(kk > 0 ? kk : 1) * sizeof(double));
        if (!s || !taken || !wd) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            if (!s || !taken || !wd) continue;
            const float *lt = logits + t * N;
            int64_t *it = idx + t * kk;
            float *wt = w + t * kk;
            float *c = s + N;
            for (int64_t i = 0; i < N; ++i) {
                s[i] = (float)k3_sig_d((double)lt[i]);
                c[i] = s[i] + bias[i];
                taken[i] = 0;
            }
            for (int64_t j = 0; j < kk; ++j) {
                int64_t best = -1;
                for (int64_t i = 0; i < N; ++i) {
                    if (taken[i]) continue;
                    if (best < 0 || ranks_before(c[i], c[best])) best = i;
                }
                taken[best] = 1;
                it[j] = best;
                wt[j] = s[best];
            }
            if (k > 1 && renorm) {
                for (int64_t j = 0; j < kk; ++j) wd[j] = (double)wt[j];
                double total = k3_lsum_d(wd, kk) + K3C_ROUTER_EPS;
                for (int64_t j = 0; j < kk; ++j) wt[j] = (float)(wd[j] / total);
            }
            for (int64_t j = 0; j < kk; ++j) wt[j] = wt[j] * fscale;
        }
        k3__free(s);
        k3__free(taken);
        k3__free(wd);
    }
    return err ? K3_ENOMEM : 0;
}
