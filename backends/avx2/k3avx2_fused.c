/* k3avx2_fused.c - layer parts in one foreign call: the ops of k3core/api/kernels.py's
 * fused defaults (attn_res_norm, kda_mix, moe_combine) called here one after the other, on
 * scratch this file allocates, with the float32 elementwise steps written as the reference
 * writes them (each product and sum rounded on its own: -ffp-contract=off). The bits are
 * therefore the separate calls'; what is saved is the Python between them (docs/avx2-backend.md,
 * "Fused layer parts"). */

/* one product of a matrix of `kind` (0 bf16, 1 f32, 2 MXFP4) */
static int fused_mm(int kind, const void *w, const uint8_t *s, int64_t rows, int64_t cols,
                    const float *x, int64_t T, float *y) {
    switch (kind) {
    case 0: return k3_matmul_bf16((const uint16_t *)w, rows, cols, x, T, y);
    case 1: return k3_matmul_f32((const float *)w, rows, cols, x, T, y);
    case 2: return k3_matmul_mxfp4((const uint8_t *)w, s, rows, cols, x, T, y);
    default: return K3_EINVAL;
    }
}

int k3_attn_res_norm(const float *src, int64_t S, int64_t T, int64_t E, const float *fold,
                     const float *w, double eps, float *y) {
    float *mix = (float *)k3__alloc((size_t)(T * E) * sizeof(float));
    if (!mix) return K3_ENOMEM;
    int rc = k3_attn_res(src, S, T, E, fold, eps, mix);
    if (rc == 0) k3_rmsnorm(mix, T, E, w, eps, y);
    k3__free(mix);
    return rc;
}

int k3_kda_mix(int kind, void **proj, uint8_t **proj_s, const void *f_b, const uint8_t *f_b_s,
               const void *o_proj, const uint8_t *o_proj_s, const float *dt_bias,
               const float *a_log, double lower_bound, const float **conv, int64_t K,
               const float *o_norm, double eps, float q_scale, int64_t E, int64_t H,
               int64_t D, int64_t R, int64_t out_rows, const float *x, int64_t T, int nseq,
               const int64_t *seq_rows, float **hist, float **state, float *y) {
    const int64_t P = H * D;
    /* rq rk rv rg z alpha cq ck cv q kk o on: P wide; rb beta: H; fa: R */
    const size_t n = (size_t)T * (size_t)(13 * P + 2 * H + R);
    float *buf = (float *)k3__alloc(n * sizeof(float));
    if (!buf) return K3_ENOMEM;
    float *rq = buf, *rk = rq + T * P, *rv = rk + T * P, *rg = rv + T * P, *z = rg + T * P;
    float *alpha = z + T * P, *cq = alpha + T * P, *ck = cq + T * P, *cv = ck + T * P;
    float *q = cv + T * P, *kk = q + T * P, *o = kk + T * P, *on = o + T * P;
    float *rb = on + T * P, *beta = rb + T * H, *fa = beta + T * H;
    void *w6[6] = {proj[0], proj[1], proj[2], proj[3], proj[4], proj[5]};
    const int64_t rows6[6] = {P, P, P, H, R, P};
    float *y6[6] = {rq, rk, rv, rb, fa, rg};
    int rc = k3_matmul_many(kind, 6, w6, proj_s, rows6, E, x, T, y6);
    if (rc) goto done;
    k3_sigmoid(rb, T * H, beta);
    rc = fused_mm(kind, f_b, f_b_s, P, R, fa, T, z);
    if (rc) goto done;
    k3_kda_gate(z, T, H, D, dt_bias, a_log, lower_bound, alpha);
    int64_t a = 0;
    for (int s = 0; s < nseq; s++) {  /* each sequence's convolutions on its own histories */
        const int64_t m = seq_rows[s];
        if (m > 0) {
            k3_shortconv(rq + a * P, m, P, conv[0], K, hist[3 * s], cq + a * P);
            k3_shortconv(rk + a * P, m, P, conv[1], K, hist[3 * s + 1], ck + a * P);
            k3_shortconv(rv + a * P, m, P, conv[2], K, hist[3 * s + 2], cv + a * P);
        }
        a += m;
    }
    k3_l2norm(cq, T * H, D, q);
    for (int64_t i = 0; i < T * P; i++) q[i] = q[i] * q_scale;
    k3_l2norm(ck, T * H, D, kk);
    a = 0;
    for (int s = 0; s < nseq; s++) {  /* and its recurrence on its own state */
        const int64_t m = seq_rows[s];
        rc = k3_kda_recurrent(q + a * P, kk + a * P, cv + a * P, alpha + a * P, beta + a * H,
                              m, H, D, D, state[s], o + a * P);
        if (rc) goto done;
        a += m;
    }
    k3_rmsnorm(o, T * H, D, o_norm, eps, on);
    k3_sigmoid(rg, T * P, rg);
    for (int64_t i = 0; i < T * P; i++) on[i] = on[i] * rg[i];
    rc = fused_mm(kind, o_proj, o_proj_s, out_rows, P, on, T, y);
done:
    k3__free(buf);
    return rc;
}

int k3_moe_combine(const float *w, const float *outs, int64_t T, int64_t k, int64_t lat,
                   const float *norm, double eps, int kind, const void *up,
                   const uint8_t *up_s, int64_t E, const float *shared, float *y) {
    float *acc = (float *)k3__alloc((size_t)(2 * T * lat) * sizeof(float));
    if (!acc) return K3_ENOMEM;
    float *normed = acc + T * lat;
    for (int64_t t = 0; t < T; t++) {
        float *a = acc + t * lat;
        for (int64_t i = 0; i < lat; i++) a[i] = 0.0f;
        for (int64_t j = 0; j < k; j++) {  /* slot by slot, each product rounded, then added */
            const float wj = w[t * k + j];
            const float *v = outs + (t * k + j) * lat;
            for (int64_t i = 0; i < lat; i++) {
                const float term = wj * v[i];
                a[i] = a[i] + term;
            }
        }
    }
    const float *in = acc;
    if (norm) {
        k3_rmsnorm(acc, T, lat, norm, eps, normed);
        in = normed;
    }
    int rc = fused_mm(kind, up, up_s, E, lat, in, T, y);
    if (rc == 0 && shared)
        for (int64_t i = 0; i < T * E; i++) y[i] = y[i] + shared[i];
    k3__free(acc);
    return rc;
}

int k3_moe_route(const float *src, int64_t S, int64_t T, int64_t E, const float *fold,
                 const float *norm, double eps, int kind, void *gate, uint8_t *gate_s,
                 void *down, uint8_t *down_s, int64_t N, int64_t lat, const float *bias,
                 int64_t k, int64_t kk, int renorm, double scale, float *xn, int64_t *idx,
                 float *w, float *z) {
    int rc = k3_attn_res_norm(src, S, T, E, fold, norm, eps, xn);
    if (rc) return rc;
    float *logits = (float *)k3__alloc((size_t)(T * N) * sizeof(float));
    if (!logits) return K3_ENOMEM;
    void *ws[2] = {gate, down};
    uint8_t *ss[2] = {gate_s, down_s};
    const int64_t rows[2] = {N, lat};
    float *ys[2] = {logits, z};
    rc = k3_matmul_many(kind, 2, ws, kind == 2 ? ss : NULL, rows, E, xn, T, ys);
    if (rc == 0 && kk > 0) rc = k3_router(logits, T, N, bias, k, kk, renorm, scale, idx, w);
    k3__free(logits);
    return rc;
}

int k3_mla_mix(int kind, const void *q_a, const uint8_t *q_a_s, const void *kv_a,
               const uint8_t *kv_a_s, const void *gate, const uint8_t *gate_s,
               const float *q_a_norm, const float *kv_a_norm, const void *q_b,
               const uint8_t *q_b_s, const void *kv_b, int kv_kind, const void *o_proj,
               const uint8_t *o_proj_s, int64_t E, int64_t QL, int64_t C, int64_t r,
               int64_t H, int64_t n, int64_t dv, int64_t out_rows, double scale, double eps,
               const float *x, int64_t T, int nseq, const int64_t *seq_rows, float **cache,
               const int64_t *pos, const int64_t *attend, float *y) {
    int64_t Q = 0;
    for (int s = 0; s < nseq; s++) Q += attend[s];
    const int part = Q < T;
    const int64_t G = gate ? H * dv : 0, W = C + r, qw = H * (n + r);
    /* ckv [T, W], lat_in and lat [T, C], xk [Q, E], qa and cq [Q, QL], g [Q, G], q [Q, qw],
     * o [Q, H * dv] */
    const size_t nf = (size_t)T * (size_t)(W + 2 * C) +
                      (size_t)Q * (size_t)((part ? E : 0) + 2 * QL + G + qw + H * dv);
    float *buf = (float *)k3__alloc(nf * sizeof(float));
    if (!buf) return K3_ENOMEM;
    float *ckv = buf, *lat_in = ckv + T * W, *lat = lat_in + T * C, *xk = lat + T * C;
    float *qa = xk + (part ? Q * E : 0), *cq = qa + Q * QL, *g = cq + Q * QL, *q = g + Q * G;
    float *o = q + Q * qw;
    int rc;
    void *w3[3] = {(void *)q_a, (void *)kv_a, (void *)gate};
    uint8_t *s3[3] = {(uint8_t *)q_a_s, (uint8_t *)kv_a_s, (uint8_t *)gate_s};
    if (!part) {  /* every row attends: the down-projections (and the gate) in one call */
        const int64_t rows3[3] = {QL, W, G};
        float *y3[3] = {qa, ckv, g};
        rc = k3_matmul_many(kind, gate ? 3 : 2, w3, kind == 2 ? s3 : NULL, rows3, E, x, T, y3);
    } else {
        rc = fused_mm(kind, kv_a, kv_a_s, W, E, x, T, ckv);
    }
    if (rc) goto done;
    for (int64_t t = 0; t < T; t++) memcpy(lat_in + t * C, ckv + t * W, (size_t)C * sizeof(float));
    k3_rmsnorm(lat_in, T, C, kv_a_norm, eps, lat);
    int64_t a = 0, j = 0;
    for (int s = 0; s < nseq; s++) {  /* every row's latent and rope key to its cache */
        for (int64_t t = 0; t < seq_rows[s]; t++) {
            float *row = cache[s] + (pos[s] + t) * W;
            memcpy(row, lat + (a + t) * C, (size_t)C * sizeof(float));
            memcpy(row + C, ckv + (a + t) * W + C, (size_t)r * sizeof(float));
        }
        if (part)  /* the rows that attend, gathered for their projections */
            for (int64_t t = seq_rows[s] - attend[s]; t < seq_rows[s]; t++, j++)
                memcpy(xk + j * E, x + (a + t) * E, (size_t)E * sizeof(float));
        a += seq_rows[s];
    }
    if (Q == 0) goto done;
    if (part) {
        void *w2[2] = {(void *)q_a, (void *)gate};
        uint8_t *s2[2] = {(uint8_t *)q_a_s, (uint8_t *)gate_s};
        const int64_t rows2[2] = {QL, G};
        float *y2[2] = {qa, g};
        rc = k3_matmul_many(kind, gate ? 2 : 1, w2, kind == 2 ? s2 : NULL, rows2, E, xk, Q, y2);
        if (rc) goto done;
    }
    k3_rmsnorm(qa, Q, QL, q_a_norm, eps, cq);
    rc = fused_mm(kind, q_b, q_b_s, qw, QL, cq, Q, q);
    if (rc) goto done;
    a = 0;
    j = 0;
    for (int s = 0; s < nseq; s++) {  /* each sequence's attending rows over its own cache */
        const int64_t m = attend[s];
        if (m > 0) {
            rc = k3_mla_latent_attention(q + j * qw, cache[s], kv_b, kv_kind, m, H, n, C, r, dv,
                                         pos[s] + seq_rows[s] - m, scale, o + j * H * dv);
            if (rc) goto done;
        }
        j += m;
        a += seq_rows[s];
    }
    if (gate) {
        k3_sigmoid(g, Q * G, g);
        for (int64_t i = 0; i < Q * G; i++) o[i] = o[i] * g[i];
    }
    rc = fused_mm(kind, o_proj, o_proj_s, out_rows, H * dv, o, Q, y);
done:
    k3__free(buf);
    return rc;
}
