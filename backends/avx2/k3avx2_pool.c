/* k3avx2_pool.c - the matrix products' own thread pool: a caller never waits for a helper
 * to ARRIVE, only for work a helper has already claimed.
 *
 * An OpenMP region ends at a barrier that every team member must reach; on a machine whose
 * other cores are busy, a helper that the scheduler has not run yet holds the caller for a
 * whole time slice, even when the caller could have done all the work itself. Here the
 * caller publishes a job (a function over items [0, n) and a chunk size), wakes the helpers
 * and starts claiming chunks at once; a helper that wakes late finds nothing left and goes
 * back to sleep. The caller returns when every item is done. Items are independent outputs
 * (matrix rows), each computed entirely by one thread, so the bits never depend on who ran
 * what.
 *
 * Claims are one 64-bit atomic: generation << 32 | next item. A helper reads the job's
 * parameters after loading the claim word and commits a chunk with a compare-and-swap of
 * that same word, so it can only ever run a chunk of the job whose parameters it read. One
 * job runs at a time (a second caller, from another OS thread, runs its job serially).
 *
 * Every parallel loop of the backend runs here (k3__pool_for), the elementwise ops and the
 * attention as well as the products: one team of threads, no OpenMP runtime. A second team
 * (libgomp's) had to be woken for every small op and, idle, spun on the core the pool's
 * helper needed, and how long it spun was libgomp's choice, fixed by the environment of
 * whichever library loaded libgomp first in the process.
 */
#include "k3avx2_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define POOL_MAX 64         /* helper threads at most */
#define POOL_SPIN_NS 200000 /* a helper spins this long for the next job before sleeping */

typedef void (*k3_job_fn)(void *ctx, int64_t begin, int64_t end);

static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t g_sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_sleep_cv = PTHREAD_COND_INITIALIZER;
static int g_helpers = 0; /* helpers started (under g_pool_lock) */
static uint32_t g_gen = 0; /* last generation published (under g_pool_lock) */
static atomic_uint_fast64_t g_claim = 0;
static atomic_llong g_done = 0;
static atomic_uint g_wake = 0;
static _Atomic(k3_job_fn) g_fn = NULL;
static _Atomic(void *) g_ctx = NULL;
static atomic_llong g_chunk = 1;
static atomic_int g_allowed = 0; /* helpers that may take part in the current job */

static double pool_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* The claim word: generation (16 bits) | next item (24) | items (24). */
#define CLAIM(gen, next, n) (((uint_fast64_t)(gen) << 48) | ((uint_fast64_t)(next) << 24) | (uint_fast64_t)(n))
#define CLAIM_NEXT(v) ((int64_t)(((v) >> 24) & 0xFFFFFF))
#define CLAIM_N(v) ((int64_t)((v) & 0xFFFFFF))
#define POOL_MAX_ITEMS 0xFFFFFF

/* Claim and run chunks of the job whose claim word is current; returns when none is left.
 * The parameters are read (acquire) after the claim word; the caller publishes a new job by
 * first closing the old word (no items), then storing the parameters (release), then the
 * new word. So if a reader saw new parameters, its compare-and-swap of an old word fails. */
static void pool_work(void) {
    for (;;) {
        uint_fast64_t v = atomic_load_explicit(&g_claim, memory_order_acquire);
        int64_t next = CLAIM_NEXT(v), n = CLAIM_N(v);
        if (next >= n) return;
        int64_t chunk = atomic_load_explicit(&g_chunk, memory_order_acquire);
        k3_job_fn fn = atomic_load_explicit(&g_fn, memory_order_acquire);
        void *ctx = atomic_load_explicit(&g_ctx, memory_order_acquire);
        int64_t end = next + chunk < n ? next + chunk : n;
        uint_fast64_t want = (v & ~(uint_fast64_t)0xFFFFFF000000u) | ((uint_fast64_t)end << 24);
        if (!atomic_compare_exchange_weak_explicit(&g_claim, &v, want, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* another thread claimed, or a newer job was published: reload */
        fn(ctx, next, end);
        atomic_fetch_add_explicit(&g_done, end - next, memory_order_release);
    }
}

static void *pool_helper(void *arg) {
    const int idx = (int)(intptr_t)arg;
    unsigned seen = atomic_load(&g_wake);
    for (;;) {
        double t0 = pool_now();
        int spins = 0;
        while (atomic_load_explicit(&g_wake, memory_order_acquire) == seen) {
            _mm_pause();
            if ((++spins & 255) == 0 && pool_now() - t0 > POOL_SPIN_NS) {
                pthread_mutex_lock(&g_sleep_lock);
                while (atomic_load(&g_wake) == seen) pthread_cond_wait(&g_sleep_cv, &g_sleep_lock);
                pthread_mutex_unlock(&g_sleep_lock);
            }
        }
        seen = atomic_load(&g_wake);
        if (idx < atomic_load_explicit(&g_allowed, memory_order_relaxed)) pool_work();
    }
    return NULL;
}

/* Run fn over [0, n) in chunks on the calling thread and up to `threads - 1` helpers. */
static void k3__pool_run(k3_job_fn fn, void *ctx, int64_t n, int64_t chunk, int threads) {
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    if (threads > POOL_MAX + 1) threads = POOL_MAX + 1;
    if (threads <= 1 || n <= chunk || n > POOL_MAX_ITEMS || pthread_mutex_trylock(&g_pool_lock) != 0) {
        fn(ctx, 0, n);
        return;
    }
    while (g_helpers < threads - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, pool_helper, (void *)(intptr_t)g_helpers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer helpers: the caller does more of the work */
        ++g_helpers;
    }
    g_gen = (g_gen + 1) & 0xFFFF;
    atomic_store_explicit(&g_claim, CLAIM(g_gen, 0, 0), memory_order_seq_cst); /* close */
    atomic_store_explicit(&g_done, 0, memory_order_relaxed);
    atomic_store_explicit(&g_fn, fn, memory_order_release);
    atomic_store_explicit(&g_ctx, ctx, memory_order_release);
    atomic_store_explicit(&g_chunk, chunk, memory_order_release);
    atomic_store_explicit(&g_allowed, threads - 1, memory_order_release);
    atomic_store_explicit(&g_claim, CLAIM(g_gen, 0, n), memory_order_release);
    atomic_fetch_add_explicit(&g_wake, 1, memory_order_release);
    pthread_mutex_lock(&g_sleep_lock);
    pthread_cond_broadcast(&g_sleep_cv);
    pthread_mutex_unlock(&g_sleep_lock);
    pool_work();
    int spins = 0;
    while (atomic_load_explicit(&g_done, memory_order_acquire) < n) {
        _mm_pause();
        if (++spins > 4096) {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
    pthread_mutex_unlock(&g_pool_lock);
}

/* A loop over the independent items [0, n): on the pool in claims of `chunk` items when
 * `par` (a K3_BIG verdict) and more than one thread is set, else on the calling thread. */
static void k3__pool_for(int par, k3_job_fn fn, void *ctx, int64_t n, int64_t chunk) {
    if (par && k3__threads() > 1)
        k3__pool_run(fn, ctx, n, chunk, k3__threads());
    else if (n > 0)
        fn(ctx, 0, n);
}

/* Claims for n items of about equal cost: four a thread, so a late helper's share is taken
 * by the other thread in small pieces; one item a claim when the parallel paths are forced
 * (the tests' small inputs must reach every thread). */
static int64_t k3__even_chunk(int64_t n) {
    if (k3__forced()) return 1;
    const int64_t parts = 4 * (int64_t)k3__threads();
    const int64_t c = (n + parts - 1) / parts;
    return c > 0 ? c : 1;
}
