/* k3avx2_experts.c - every routed expert of one MoE layer in one call (k3_situ_mlp_many).
 *
 * Expert e applies y_e = W2_e . situ_glu(W1_e . x_e, W3_e . x_e, b1, b2) to its own token
 * rows x_e[T_e, cols]. Each output element is the same lane sum as k3_situ_mlp gives (the
 * row kernels of k3avx2_matmul.c), so the bits are the per-expert calls'. What changes is
 * the scheduling: the W1/W3 rows of all experts go out as one job on the pool, then one
 * SiTU pass over all of them, then the W2 rows of all experts as one job - three pool
 * dispatches per layer instead of three per expert, and a thread that finishes one expert's
 * rows takes the next expert's at once.
 *
 * An expert with more tokens than a token block (k3avx2_matmul.c token_block) is cut into
 * pieces of at most a block; experts go in groups whose widened activations stay under
 * MANY_BYTES, so memory is bounded whatever the prompt length.
 */
#include "k3avx2_internal.h"

#define MANY_BYTES (16 << 20) /* widened float64 activations of one group of pieces */

/* A matrix applied to its own widened tokens. */
typedef struct {
    const void *w;
    const uint8_t *sc;
    int64_t rows;
    float *y; /* first token's output row: y[t * rows + o] */
    const double *xd;
    int64_t nt;
    int64_t first; /* index of this matrix's row 0 in the job's concatenated rows */
    int blocked;   /* use_blocked's path for its tokens (k3avx2_matmul.c) */
} k3_tmat;

typedef struct {
    enum k3_wkind kind;
    const k3_tmat *m;
    int64_t n;
    int64_t cols, cp;
} tmats_job;

static void tmats_job_fn(void *ctx, int64_t b, int64_t e) {
    const tmats_job *j = (const tmats_job *)ctx;
    int64_t lo = 0, hi = j->n - 1; /* the matrix holding row b: last with first <= b */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (j->m[mid].first <= b) lo = mid; else hi = mid - 1;
    }
    int64_t i = lo, o = b - j->m[i].first;
    for (int64_t g = b; g < e;) {
        while (o >= j->m[i].rows) o -= j->m[i++].rows;
        const int64_t nr = tile_rows(j->m[i].blocked, e - g, j->m[i].rows - o);
        do_rows(j->kind, j->m[i].blocked, j->m[i].w, j->m[i].sc, o, nr, j->m[i].rows, j->cols, j->cp,
                j->m[i].xd, j->m[i].nt, j->m[i].y, rows_ahead(e - g, j->m[i].rows - o, nr));
        g += nr;
        o += nr;
    }
}

static void tmats_run(enum k3_wkind kind, k3_tmat *m, int64_t n, int64_t cols, int64_t cp,
                      int par) {
    int64_t total = 0, work = 0;
    int path = K3_PATH_ONE; /* the chunks of one-token tiles where every matrix takes them */
    for (int64_t i = 0; i < n; ++i) {
        m[i].first = total;
        total += m[i].rows;
        work += m[i].rows * m[i].nt;
        if (m[i].blocked != K3_PATH_ONE) path = m[i].blocked;
    }
    tmats_job j = {kind, m, n, cols, cp};
    if (par) /* claims sized by the tokens of an average row (row_chunk) */
        k3__pool_run(tmats_job_fn, &j, total, row_chunk(path, cp, total, total ? work / total : 1),
                     k3__threads());
    else
        tmats_job_fn(&j, 0, total);
}

/* One piece: tokens [t0, t0 + nt) of expert e, multiplied on use_blocked's path `path`;
 * r is its first token's row among its group's widened activations. */
typedef struct {
    int64_t e, t0, nt, r;
    int path;
} k3_piece;

/* The pieces' activations widened on the pool, a piece a claim: each in its own path's
 * order, from x[e] (the W1/W3 input) or from the SiTU output a (the W2 input), whose rows
 * are the group's rows. */
typedef struct {
    enum k3_wkind kind;
    const k3_piece *pc;
    const float **x; /* NULL: from a */
    const float *a;
    double *xd;
    int64_t cols, cp;
} widen_pieces_job;

static void widen_pieces_fn(void *ctx, int64_t b, int64_t e) {
    const widen_pieces_job *j = (const widen_pieces_job *)ctx;
    for (int64_t p = b; p < e; ++p) {
        const k3_piece *q = j->pc + p;
        const float *src = j->x ? j->x[q->e] + q->t0 * j->cols : j->a + q->r * j->cols;
        widen_x(j->xd + q->r * j->cp, src, q->nt, j->cols, j->cp, x_order(j->kind, q->path));
    }
}

static void widen_pieces(widen_pieces_job *j, int64_t p0, int64_t p1, int par) {
    if (par && p1 - p0 > 1)
        k3__pool_run(widen_pieces_fn, j, p1 - p0, 1, k3__threads());
    else
        widen_pieces_fn(j, 0, p1 - p0);
}

int k3_situ_mlp_many(int kind, int n, void **w1, uint8_t **s1, void **w3, uint8_t **s3,
                     void **w2, uint8_t **s2, int64_t inter, int64_t cols, int64_t out_rows,
                     const float **x, const int64_t *T, double b1, double b2, float **y) {
    if (n < 0 || kind < K3_W_BF16 || kind > K3_W_MXFP4 || inter < 1 || cols < 1 || out_rows < 1)
        return K3_EINVAL;
    if (kind == K3_W_MXFP4 && (cols % K3C_MXFP4_GROUP || inter % K3C_MXFP4_GROUP)) return K3_EINVAL;
    const enum k3_wkind kd = (enum k3_wkind)kind;
    const int64_t cp = ROUND32(cols), ip = ROUND32(inter);
    const int64_t tb = token_block(kd, INT64_MAX / 2, cp > ip ? cp : ip);
    int64_t npieces = 0, tokens = 0;
    for (int i = 0; i < n; ++i) {
        if (T[i] < 0) return K3_EINVAL;
        npieces += (T[i] + tb - 1) / tb;
        tokens += T[i];
    }
    if (tokens == 0) return 0;
    /* tokens per group: every piece of the group widened at once, at least one block */
    int64_t gt = MANY_BYTES / ((cp > ip ? cp : ip) * (int64_t)sizeof(double));
    if (gt < tb) gt = tb;
    if (gt > tokens) gt = tokens;
    k3_piece *pc = (k3_piece *)k3__alloc((size_t)npieces * sizeof(k3_piece));
    k3_tmat *m = (k3_tmat *)k3__alloc((size_t)(2 * npieces + 1) * sizeof(k3_tmat));
    double *xd = (double *)k3__alloc((size_t)(gt * cp) * sizeof(double));
    double *ad = (double *)k3__alloc((size_t)(gt * ip) * sizeof(double));
    float *h = (float *)k3__alloc((size_t)(3 * gt * inter) * sizeof(float));
    int rc = 0;
    if (!pc || !m || !xd || !ad || !h) {
        rc = K3_ENOMEM;
        goto out;
    }
    int64_t np = 0;
    for (int i = 0; i < n; ++i)
        for (int64_t t0 = 0; t0 < T[i]; t0 += tb) {
            pc[np].e = i;
            pc[np].t0 = t0;
            pc[np].nt = T[i] - t0 < tb ? T[i] - t0 : tb;
            pc[np].path = use_blocked(kd, pc[np].nt); /* the piece's own path */
            ++np;
        }
    float *h1 = h, *h3 = h + gt * inter, *a = h + 2 * gt * inter;
    for (int64_t p0 = 0; p0 < np;) {
        /* the pieces [p0, p1) whose tokens fit the group */
        int64_t p1 = p0, rows = 0;
        while (p1 < np && rows + pc[p1].nt <= gt) rows += pc[p1++].nt;
        const int par = K3_BIG((2 * inter * cols + out_rows * inter) * rows, K3_PAR_MATMUL);
        int64_t nm = 0;
        for (int64_t p = p0, r = 0; p < p1; ++p) { /* each piece's first row in the group */
            pc[p].r = r;
            r += pc[p].nt;
        }
        widen_pieces_job wj = {kd, pc + p0, x, NULL, xd, cols, cp};
        widen_pieces(&wj, p0, p1, par);
        for (int64_t p = p0; p < p1; ++p) {
            const int64_t e = pc[p].e, r = pc[p].r;
            const int bl = pc[p].path;
            const uint8_t *sc1 = s1 ? s1[e] : NULL, *sc3 = s3 ? s3[e] : NULL;
            m[nm++] = (k3_tmat){w1[e], sc1, inter, h1 + r * inter, xd + r * cp, pc[p].nt, 0, bl};
            m[nm++] = (k3_tmat){w3[e], sc3, inter, h3 + r * inter, xd + r * cp, pc[p].nt, 0, bl};
        }
        tmats_run(kd, m, nm, cols, cp, par);
        situ_job sj = {h1, h3, a, b1, b2};
        if (par)
            k3__pool_run(situ_job_fn, &sj, rows * inter, k3__forced() ? 1 : SITU_CHUNK,
                         k3__threads());
        else
            situ_job_fn(&sj, 0, rows * inter);
        widen_pieces_job wa = {kd, pc + p0, NULL, a, ad, inter, ip};
        widen_pieces(&wa, p0, p1, par);
        nm = 0;
        for (int64_t p = p0; p < p1; ++p) {
            const int64_t e = pc[p].e;
            const int bl = pc[p].path;
            const uint8_t *sc2 = s2 ? s2[e] : NULL;
            m[nm++] = (k3_tmat){w2[e], sc2, out_rows, y[e] + pc[p].t0 * out_rows,
                                ad + pc[p].r * ip, pc[p].nt, 0, bl};
        }
        tmats_run(kd, m, nm, inter, ip, par);
        p0 = p1;
    }
out:
    k3__free(pc);
    k3__free(m);
    k3__free(xd);
    k3__free(ad);
    k3__free(h);
    return rc;
}
