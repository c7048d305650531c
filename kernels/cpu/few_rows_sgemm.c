/* Few-row float32 products for MLX's CPU backend: a verify pass's x @ W.T.
 *
 * MLX hands every float32 matmul to cblas_sgemm. For the products a decoding step makes,
 * a handful of rows against a weight matrix read from memory, OpenBLAS's sgemm packs the
 * operands and reads the weights at a fraction of the memory bandwidth: on this project's
 * 2-core VMs a 1-row 576 x 1536 product took ~220 us, where streaming the 3.5 MB once
 * takes ~60. This library, preloaded ahead of OpenBLAS (engine/few_rows.py), serves
 * row-major C = A @ B.T with at most MAX_ROWS rows of A itself and passes every other
 * call on to the next cblas_sgemm.
 *
 * Every output is one 8-lane accumulator over K in order, summed across lanes, then K's
 * tail: the same arithmetic whatever the number of rows and wherever the output falls in
 * a tile, so a row of a 16-row verify pass equals the 1-row step's bit for bit (the
 * lossless rules compare them). Tiles: a 1-2 row product streams each row of B once
 * (one read stream per thread is what keeps the memory busy); wider ones take groups of
 * up to 8 rows of A (3 without AVX-512VL) against 3-6 rows of B, and fetch the next tile
 * of B into L2 while the first group meets this one: without that, the first tile of
 * each group waited on memory and the rest on nothing, and a 4-12 row product took
 * 1.3-1.8x as long (cold 576 x 1536: 8 rows ~240 -> ~140 us, 16 ~330 -> ~230, with 3 x 4
 * tiles), as did 4-6 rows streamed.
 *
 * Threads: as many as OpenBLAS is set to (engine/blas_threads.py follows the machine's
 * load), splitting B's rows; the helpers spin briefly between jobs, then sleep. The pool
 * runs any job (understudy_parallel): attention.c's too, built into the same library.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define MAX_ROWS 64    /* a verify pass's rows at most; prompt chunks go to OpenBLAS */
#define MAX_THREADS 64
#define SPIN 20000     /* pause loops a helper waits for the next product before sleeping */
#define STREAM_ROWS 2 /* at most (1-2) rows of A streamed against each row of B (else tiles) */
#define STREAM_BYTES (20 * 1024) /* of A's rows: what L1 holds beside a row of B */
#define MIN_SPLIT (1 << 16) /* multiply-adds below which one thread does the whole product */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef int (*threads_fn)(void);

static sgemm_fn next_sgemm;
static threads_fn blas_threads;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void after_fork_in_child(void);

static void resolve(void) {
    next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    blas_threads = (threads_fn)dlsym(RTLD_DEFAULT, "openblas_get_num_threads");
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

static inline float lanes_sum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

typedef struct {
    int M, N, K, lda, ldb, ldc;
    float alpha, beta;
    const float *A, *B;
    float *C;
} Product;

/* C[i][j] for i < MR rows from A and j < NR rows from B, MR and NR known at each call
   site so the accumulators live in registers. `ahead`, when given: NR rows of B (as far
   apart as B's) to fetch into L2 meanwhile, a cache line of each every 16 floats of K */
static inline __attribute__((always_inline)) void tile(const int MR, const int NR,
                                                       const Product *p, int m, int n,
                                                       const float *ahead) {
    const float *A = p->A + (size_t)m * p->lda, *B = p->B + (size_t)n * p->ldb;
    const int K = p->K, K8 = K & ~7;
    __m256 acc[8][6];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    for (int k = 0; k < K8; k += 8) {
        __m256 b[6];
        if (ahead && !(k & 15))
            for (int j = 0; j < NR; j++)
                _mm_prefetch((const char *)(ahead + (size_t)j * p->ldb + k), _MM_HINT_T1);
        for (int j = 0; j < NR; j++) b[j] = _mm256_loadu_ps(B + (size_t)j * p->ldb + k);
        for (int i = 0; i < MR; i++) {
            __m256 a = _mm256_loadu_ps(A + (size_t)i * p->lda + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            const float *a = A + (size_t)i * p->lda, *b = B + (size_t)j * p->ldb;
            float s = lanes_sum(acc[i][j]);
            for (int k = K8; k < K; k++) s += a[k] * b[k];
            float *c = p->C + (size_t)(m + i) * p->ldc + n + j;
            *c = p->beta == 0.0f ? p->alpha * s : p->alpha * s + p->beta * *c;
        }
}

/* Rows of A a tile takes at most. With AVX-512VL's 32 vector registers (the library is
   built with it where the CPU has it) a tile holds up to 24 accumulators: 4 x 6, 6 x 4 or
   8 x 3; with AVX2's 16, 3 x 4 (which already spills one). Fewer loads per multiply-add:
   on this project's 2-core VMs an 8-row 576 x 1536 product ~120 -> ~90 us, 16 rows
   ~210 -> ~175, 3 rows against K = 1536 (streamed before) ~130 -> ~70. The arithmetic
   of an output is the same in every tile. */
#ifdef __AVX512VL__
#define MAX_MR 8
#else
#define MAX_MR 3
#endif

/* a tile whose shape is known only at run time: a switch onto each shape product_part
   asks for, so that every one is compiled with its accumulators in registers */
#define T(mr, nr) case mr * 8 + nr: tile(mr, nr, p, m, n, ahead); return;
static void tile_any(int MR, int NR, const Product *p, int m, int n, const float *ahead) {
    switch (MR * 8 + NR) {
    T(1, 1) T(2, 1) T(3, 1) T(1, 4) T(2, 4) T(3, 4)
#ifdef __AVX512VL__
    T(4, 1) T(5, 1) T(6, 1) T(7, 1) T(8, 1)
    T(1, 6) T(2, 6) T(3, 6) T(4, 6) T(4, 4) T(5, 4) T(6, 4) T(6, 3) T(7, 3) T(8, 3)
#endif
    }
    __builtin_trap(); /* a shape product_part never asks for (the tests try every M) */
}
#undef T

/* columns of B per tile for groups of at most `mr` rows of A (and one fewer) */
static int tile_cols(int mr) {
#ifdef __AVX512VL__
    return mr <= 4 ? 6 : mr <= 6 ? 4 : 3;
#else
    (void)mr;
    return 4;
#endif
}

/* every row of A against rows n0..n1 of B */
static void product_part(const Product *p, int n0, int n1) {
    const int M = p->M;
    if (M <= STREAM_ROWS && (long)M * p->K * 4 <= STREAM_BYTES) {
        /* A stays in L1 while each row of B streams past once */
        for (int n = n0; n < n1; n++) {
            if (M == 2) tile(2, 1, p, 0, n, NULL);
            else tile(1, 1, p, 0, n, NULL);
        }
        return;
    }
    /* A's rows in groups as even as can be (sizes g and g - 1 at most MAX_MR), each
       group against each tile of B; the next tile's rows of B come from memory while the
       first group meets these, and the other groups then find them in L2 */
    const int groups = (M + MAX_MR - 1) / MAX_MR, NR = tile_cols((M + groups - 1) / groups);
    int n = n0;
    for (; n + NR <= n1; n += NR) {
        const float *next = n + 2 * NR <= n1 ? p->B + (size_t)(n + NR) * p->ldb : NULL;
        for (int g = 0, m = 0; g < groups; g++) {
            const int mr = (M - m) / (groups - g);
            tile_any(mr, NR, p, m, n, g == 0 ? next : NULL);
            m += mr;
        }
    }
    for (; n < n1; n++)
        for (int g = 0, m = 0; g < groups; g++) {
            const int mr = (M - m) / (groups - g);
            tile_any(mr, 1, p, m, n, NULL);
            m += mr;
        }
}

/* ---- the helpers: one job at a time, handed over by a generation counter. A job is a
   function every thread calls with its part number (products here, attention in
   attention.c through understudy_parallel) ---- */
typedef void (*part_fn)(const void *job, int part, int parts);

static struct {
    pthread_mutex_t busy; /* one job in flight; another caller computes alone */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_uint generation;
    atomic_int pending;
    int started, parts;
    unsigned born[MAX_THREADS]; /* the generation each helper was started at */
    part_fn fn;
    const void *job;
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

/* a forked child has none of the parent's helpers (and maybe a lock a parent's thread
   held): it starts its own pool, as needed */
static void after_fork_in_child(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
}

static void part_bounds(int part, int parts, int N, int *n0, int *n1) {
    int per = ((N + parts - 1) / parts + 11) / 12 * 12; /* whole tiles (of 1-6 rows) per part */
    *n0 = part * per;
    *n1 = *n0 + per < N ? *n0 + per : N;
}

static void *helper(void *arg) {
    const int part = (int)(size_t)arg;
    unsigned seen = pool.born[part];
    for (;;) {
        for (int i = 0; i < SPIN && atomic_load(&pool.generation) == seen; i++) _mm_pause();
        if (atomic_load(&pool.generation) == seen) {
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load(&pool.generation);
        if (part < pool.parts) pool.fn(pool.job, part, pool.parts);
        atomic_fetch_sub(&pool.pending, 1); /* every helper, with a part or without */
    }
    return NULL;
}

/* fn(job, part, parts) for every part, on as many threads as OpenBLAS is set to where
   the job's `work` (multiply-adds) is worth splitting; parts = 1 where it is not, or
   where another job is in flight */
void understudy_parallel(part_fn fn, const void *job, long work) {
    pthread_once(&once, resolve);
    int threads = 1;
    if (work >= MIN_SPLIT && blas_threads) {
        threads = blas_threads();
        threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    }
    if (threads == 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(job, 0, 1);
        return;
    }
    while (pool.started < threads - 1) { /* helpers are started once, as first needed */
        pthread_t t;
        pool.born[pool.started + 1] = atomic_load(&pool.generation);
        if (pthread_create(&t, NULL, helper, (void *)(size_t)(pool.started + 1)) != 0) break;
        pthread_detach(t);
        pool.started++;
    }
    int parts = pool.started + 1 < threads ? pool.started + 1 : threads;
    pool.fn = fn;
    pool.job = job;
    pool.parts = parts;
    atomic_store(&pool.pending, pool.started);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    fn(job, 0, parts);
    while (atomic_load(&pool.pending) > 0) _mm_pause();
    pthread_mutex_unlock(&pool.busy);
}

static void product_job(const void *job, int part, int parts) {
    const Product *p = job;
    int n0, n1;
    part_bounds(part, parts, p->N, &n0, &n1);
    if (n0 < n1) product_part(p, n0, n1);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C,
                 int ldc) {
    pthread_once(&once, resolve);
    if (order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && M >= 1 &&
        M <= MAX_ROWS && N >= 1 && K >= 1) {
        Product p = {M, N, K, lda, ldb, ldc, alpha, beta, A, B, C};
        understudy_parallel(product_job, &p, (long)M * N * K);
        return;
    }
    if (next_sgemm) next_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
