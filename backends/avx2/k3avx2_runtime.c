/* k3avx2_runtime.c - thread count, aligned scratch, the memory read bandwidth and FMA
 * probes used by the kernel benchmark, and the GIL rendezvous diagnostic. */
#include "k3avx2_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

/* The thread count is per calling thread: Python sets it right before each kernel call
 * (Avx2Backend._sync_threads), so two backends with different counts used from two Python
 * threads at once never see each other's setting. */
static _Thread_local int g_threads = 1;

void k3_set_threads(int n) { g_threads = n < 1 ? 1 : n; }
int k3__threads(void) { return g_threads; }

/* Per calling thread too: every parallel region taken whatever its size (testing aid). */
static _Thread_local int g_forced = 0;

void k3_set_force_parallel(int on) { g_forced = on != 0; }
int k3__forced(void) { return g_forced; }

/* Parallel regions entered with more than one thread since the process started (relaxed:
 * a diagnostic for the tests that must know the multi-threaded code ran). */
static atomic_llong g_par_regions = 0;

int k3__par(int big) {
    if (big && g_threads > 1) atomic_fetch_add_explicit(&g_par_regions, 1, memory_order_relaxed);
    return big;
}

long long k3_parallel_regions(void) { return atomic_load(&g_par_regions); }


int k3_has_avx512(void) {
#if defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

void *k3__alloc(size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 64;
    if (posix_memalign(&p, 64, bytes) != 0) return NULL;
    return p;
}

void k3__free(void *p) { free(p); }

/* The per-thread scratch: grown on demand, released by the key's destructor at thread exit
 * (pool helpers keep theirs for the life of the process). */
static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;
static int g_scratch_key_ok = 0;
static _Thread_local void *g_scratch = NULL;
static _Thread_local size_t g_scratch_n = 0;

static void scratch_key(void) { g_scratch_key_ok = pthread_key_create(&g_scratch_key, free) == 0; }

void *k3__scratch(size_t n) {
    if (n <= g_scratch_n) return g_scratch;
    pthread_once(&g_scratch_once, scratch_key);
    if (!g_scratch_key_ok) return NULL;
    void *p = k3__alloc(n);
    if (!p || pthread_setspecific(g_scratch_key, p) != 0) {
        k3__free(p);
        return NULL;
    }
    k3__free(g_scratch);
    g_scratch = p;
    g_scratch_n = n;
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the machine's ceilings, every thread at once ------------------------------------
 * The two probes below must run on all `threads` threads at the same time, which the pool
 * does not promise (a caller takes a late helper's share), so they start a team of their own
 * threads. Thread 0 is the caller; each pass starts after a barrier that every member has
 * reached and ends after another, so the thread starts are never timed. */
#define TEAM_MAX 64

typedef struct k3_team k3_team;
typedef void (*k3_team_fn)(k3_team *t, int idx);
struct k3_team {
    k3_team_fn fn;
    int threads, repeat;
    atomic_int go; /* the member count is final: start */
    pthread_barrier_t bar;
    double best;
    /* the read probe */
    const uint8_t *buf;
    int64_t blocks;
    uint64_t part[TEAM_MAX]; /* each member's XOR */
    /* the FMA probe */
    int64_t iters;
    double fsum[TEAM_MAX]; /* each member's chain sums */
};

typedef struct {
    k3_team *t;
    int idx;
} k3_member;

static void *team_member(void *arg) {
    const k3_member *m = (const k3_member *)arg;
    while (!atomic_load_explicit(&m->t->go, memory_order_acquire)) {
        struct timespec ts = {0, 10000};
        nanosleep(&ts, NULL);
    }
    m->t->fn(m->t, m->idx);
    return NULL;
}

/* Run t->fn on `threads` threads (fewer if a thread cannot be started: the members wait
 * until the caller knows how many there are) and wait for all of them. */
static void team_run(k3_team *t, int threads) {
    pthread_t th[TEAM_MAX];
    k3_member mem[TEAM_MAX];
    if (threads < 1) threads = 1;
    if (threads > TEAM_MAX) threads = TEAM_MAX;
    t->best = 1e300;
    atomic_store(&t->go, 0);
    int started = 1;
    for (int i = 1; i < threads; ++i) {
        mem[i] = (k3_member){t, i};
        if (pthread_create(&th[i], NULL, team_member, &mem[i]) != 0) break;
        ++started;
    }
    t->threads = started;
    pthread_barrier_init(&t->bar, NULL, (unsigned)started);
    atomic_store_explicit(&t->go, 1, memory_order_release);
    t->fn(t, 0);
    for (int i = 1; i < started; ++i) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&t->bar);
}

/* Each pass: barrier, work, barrier; thread 0 times the span between its two barriers. */
static void read_member(k3_team *t, int idx) {
    const int64_t b0 = t->blocks * idx / t->threads, b1 = t->blocks * (idx + 1) / t->threads;
    for (int rep = 0; rep < t->repeat; ++rep) {
        pthread_barrier_wait(&t->bar);
        const double t0 = now_s();
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t b = b0; b < b1; ++b) {
            const __m256i *p = (const __m256i *)(t->buf + (size_t)b * 128);
            a0 = _mm256_xor_si256(a0, _mm256_load_si256(p));
            a1 = _mm256_xor_si256(a1, _mm256_load_si256(p + 1));
            a2 = _mm256_xor_si256(a2, _mm256_load_si256(p + 2));
            a3 = _mm256_xor_si256(a3, _mm256_load_si256(p + 3));
        }
        a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
        t->part[idx] ^= (uint64_t)_mm256_extract_epi64(a0, 0) ^ (uint64_t)_mm256_extract_epi64(a0, 1) ^
                        (uint64_t)_mm256_extract_epi64(a0, 2) ^ (uint64_t)_mm256_extract_epi64(a0, 3);
        pthread_barrier_wait(&t->bar);
        if (idx == 0) {
            const double dt = now_s() - t0;
            if (dt < t->best) t->best = dt;
        }
    }
}

/* Read `nbytes` of `buf` (64-byte aligned, a multiple of 128) `repeat` times with the
 * current thread count, each thread streaming its own contiguous slice with 256-bit loads
 * (an XOR reduction the compiler cannot drop). Returns the best seconds per pass. */
double k3_read_bandwidth(const uint8_t *buf, size_t nbytes, int repeat, uint64_t *checksum) {
    k3_team t;
    memset(&t, 0, sizeof t);
    t.fn = read_member;
    t.repeat = repeat < 1 ? 1 : repeat;
    t.buf = buf;
    t.blocks = (int64_t)(nbytes / 128);
    team_run(&t, k3__threads());
    uint64_t sum = 0;
    for (int i = 0; i < t.threads; ++i) sum ^= t.part[i];
    if (checksum) *checksum = sum;
    return t.best;
}

/* The float64 FMA ceiling of the matrix products: every thread runs twelve independent
 * chains of `iters` FMAs on 512-bit registers (AVX-512) or 256-bit ones (AVX2), enough
 * chains to cover the FMA latency on both pipes. k3_fma_peak returns the best seconds per
 * pass; the caller divides `threads x iters x 12 x lanes` by it (lanes: 8, or 4 without
 * AVX-512, the return value of k3_has_avx512 says which). `sink` keeps the chains alive.
 * K3_FMA_CHAINS defines the twelve chains at one register width, returning their sum. */
#define K3_FMA_CHAINS(NAME, TARGET, VEC, SET1, FMA, STORE, LANES)                              \
    __attribute__((target(TARGET))) static double NAME(int64_t iters) {                       \
        VEC a[12];                                                                             \
        const VEC m = SET1(1.0000001), c = SET1(1e-9);                                         \
        for (int i = 0; i < 12; ++i) a[i] = SET1((double)i);                                   \
        for (int64_t k = 0; k < iters; ++k)                                                    \
            for (int i = 0; i < 12; ++i) a[i] = FMA(a[i], m, c);                               \
        double s = 0.0, t[LANES];                                                              \
        for (int i = 0; i < 12; ++i) {                                                         \
            STORE(t, a[i]);                                                                    \
            for (int l = 0; l < LANES; ++l) s += t[l];                                         \
        }                                                                                      \
        return s;                                                                              \
    }
K3_FMA_CHAINS(fma_chains512, "avx512f,fma", __m512d, _mm512_set1_pd, _mm512_fmadd_pd,
              _mm512_storeu_pd, 8)
K3_FMA_CHAINS(fma_chains256, "avx2,fma", __m256d, _mm256_set1_pd, _mm256_fmadd_pd,
              _mm256_storeu_pd, 4)
#undef K3_FMA_CHAINS

static void fma_member(k3_team *t, int idx) {
    const int wide = k3_has_avx512();
    for (int rep = 0; rep < t->repeat; ++rep) {
        pthread_barrier_wait(&t->bar);
        const double t0 = now_s();
        t->fsum[idx] += wide ? fma_chains512(t->iters) : fma_chains256(t->iters);
        pthread_barrier_wait(&t->bar);
        if (idx == 0) {
            const double dt = now_s() - t0;
            if (dt < t->best) t->best = dt;
        }
    }
}

/* A compute ceiling's team: `fn` on every thread, `repeat` passes of `iters` steps each, the
 * members' sums in `*sink` (they keep the work alive); the best seconds per pass. */
static double team_peak(k3_team_fn fn, int64_t iters, int repeat, double *sink) {
    k3_team t;
    memset(&t, 0, sizeof t);
    t.fn = fn;
    t.repeat = repeat < 1 ? 1 : repeat;
    t.iters = iters;
    team_run(&t, k3__threads());
    double total = 0.0;
    for (int i = 0; i < t.threads; ++i) total += t.fsum[i];
    if (sink) *sink = total;
    return t.best;
}

double k3_fma_peak(int64_t iters, int repeat, double *sink) {
    return team_peak(fma_member, iters, repeat, sink);
}

/* Diagnostic for the GIL: each of `parties` Python threads calls this; each call checks in
 * and waits until all have checked in (or the timeout passes). All calls return 1 only if
 * they were inside C at the same time, which is impossible unless the GIL is released. */
static atomic_int g_rendezvous = 0;

int k3_gil_rendezvous(int parties, double timeout_s) {
    int arrived = atomic_fetch_add(&g_rendezvous, 1) + 1;
    double t0 = now_s();
    int ok = arrived >= parties;
    while (!ok && now_s() - t0 < timeout_s) {
        int cur = atomic_load(&g_rendezvous);
        ok = cur >= parties || cur == 0; /* 0: the group already met and reset */
        if (!ok) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        }
    }
    /* the last one out resets the counter for the next test */
    if (ok) {
        int expected = parties;
        atomic_compare_exchange_strong(&g_rendezvous, &expected, 0);
    } else {
        atomic_fetch_sub(&g_rendezvous, 1);
    }
    return ok;
}

/* The contract constants this build was compiled with, in the order the Python side
 * checks them against k3core/api/contract.py (a stale build is refused, never used):
 * LANES, MXFP4_GROUP, EXP_HI, EXP_LO, LOG2E, LN2_HI, LN2_LO, EXPM1_SERIES_MAX, TANH_SAT,
 * L2_EPS, ROUTER_EPS, EXP_COEF[], EXPM1_COEF[], E2M1[16], E8M0[256].
 * Returns the number of values (writes at most `cap`). */
int k3_contract_values(double *out, int cap) {
    double v[11 + K3C_EXP_NCOEF + K3C_EXPM1_NCOEF + 16 + 256];
    int n = 0;
    v[n++] = K3C_LANES;
    v[n++] = K3C_MXFP4_GROUP;
    v[n++] = K3C_EXP_HI;
    v[n++] = K3C_EXP_LO;
    v[n++] = K3C_LOG2E;
    v[n++] = K3C_LN2_HI;
    v[n++] = K3C_LN2_LO;
    v[n++] = K3C_EXPM1_SERIES_MAX;
    v[n++] = K3C_TANH_SAT;
    v[n++] = K3C_L2_EPS;
    v[n++] = K3C_ROUTER_EPS;
    for (int i = 0; i < K3C_EXP_NCOEF; ++i) v[n++] = K3C_EXP_COEF[i];
    for (int i = 0; i < K3C_EXPM1_NCOEF; ++i) v[n++] = K3C_EXPM1_COEF[i];
    for (int i = 0; i < 16; ++i) v[n++] = K3C_E2M1[i];
    for (int i = 0; i < 256; ++i) v[n++] = K3C_E8M0[i];
    for (int i = 0; i < n && i < cap; ++i) out[i] = v[i];
    return n;
}
