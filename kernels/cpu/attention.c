/* Attention of an inference pass on the CPU: softmax(q k^T * scale) v, each query row over
 * the keys it may see, the heads that share a kv head (up to GROUP of them) together so
 * each key and value row is loaded once for all of them.
 *
 * MLX's CPU backend ran it as two batched products (sgemm through few_rows_sgemm.c and
 * OpenBLAS), a softmax between them and the conversions around it: for the demo at 600
 * cached tokens a 13-row verify pass took ~85 ms with it and ~54 ms with this kernel, at
 * 1,000 tokens ~110 against ~60; most of the difference was per-call overhead on small
 * products. Calls too small to split (a 1-token step's) run on the calling thread.
 *
 * Exactness across widths, the lossless rules' concern: a row sees its visible keys in
 * ascending order, packed (a tree row's ancestors follow the committed prefix directly),
 * and every sum runs over that packed sequence in a fixed order: a score is 8 lanes over
 * the head dimension then a fixed tree of adds, the weights' total is 8 lanes over the
 * packed keys then the same tree, the output is one running sum per dimension in key
 * order. A row of a causal verify pass, or a tree node's row, therefore equals the row a
 * 1-token pass computes at that position once the path's keys are in place, bit for bit.
 *
 * Threads: the rows are split across the helpers of few_rows_sgemm.c (understudy_parallel).
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>

typedef void (*part_fn)(const void *job, int part, int parts);
void understudy_parallel(part_fn fn, const void *job, long work);

#define MAX_DIM 512 /* head dimensions above this are left to MLX (as are ones not a multiple of 8) */
#define SPLIT_WORK (1L << 21) /* multiply-adds below which one thread serves the whole call */

/* Strides in floats; each row's last dimension is contiguous. The mask, when given, is
 * (L, S) bytes, nonzero = attend; none = causal (row l sees keys up to S - L + l). */
typedef struct {
    const float *q;
    long q_batch, q_head, q_row;
    const float *k;
    long k_batch, k_head, k_row;
    const float *v;
    long v_batch, v_head, v_row;
    float *out;
    long out_batch, out_head, out_row;
    const unsigned char *mask;
    long mask_batch, mask_row; /* mask_batch 0: one mask for every sequence */
    int batch, heads, kv_heads, rows, keys, dim;
    float scale;
} Attention;

/* per-thread buffers, grown as the key count does: GROUP rows' scores, the visible keys */
static __thread float *t_scores;
static __thread int *t_index;
static __thread long t_capacity;

#define GROUP 3 /* query rows (heads of one kv head, at one position) that share each key's loads */

/* a thread's buffers are freed when it exits (an engine or job thread may come and go) */
static pthread_key_t buffers_key;
static pthread_once_t buffers_once = PTHREAD_ONCE_INIT;

static void free_buffers(void *unused) {
    (void)unused;
    free(t_scores);
    free(t_index);
    t_scores = NULL;
    t_index = NULL;
    t_capacity = 0;
}

static void make_buffers_key(void) { pthread_key_create(&buffers_key, free_buffers); }

static int reserve(long keys) {
    long want = (keys + 8) & ~7L;
    if (want <= t_capacity) return 1;
    pthread_once(&buffers_once, make_buffers_key);
    float *s = realloc(t_scores, (size_t)want * GROUP * sizeof(float));
    if (!s) return 0;
    t_scores = s;
    int *i = realloc(t_index, (size_t)want * sizeof(int));
    if (!i) return 0;
    t_index = i;
    t_capacity = want;
    pthread_setspecific(buffers_key, (void *)1); /* any non-NULL value: run the destructor */
    return 1;
}

/* lane sums of 4 vectors, lane i from v_i: ((0+1)+(2+3))+((4+5)+(6+7)) */
static inline __m128 sums4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    __m256 z = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

/* e^x for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7
 * (relative error ~2e-8 before rounding); below -87 it is 0 */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 floor_x = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
    x = _mm256_max_ps(x, floor_x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

static const float zeros[MAX_DIM];

/* R rows' scores against keys b..b+3 (zeros past the last): q rows scaled, d apart */
static inline __attribute__((always_inline)) void score_tile(const int R, const float *qs,
                                                             const float *kp[4], int d,
                                                             float *scores, long stride) {
    __m256 acc[GROUP][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
        __m256 kv[4];
        for (int i = 0; i < 4; i++) kv[i] = _mm256_loadu_ps(kp[i] + c);
        for (int r = 0; r < R; r++) {
            __m256 qv = _mm256_loadu_ps(qs + r * d + c);
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_fmadd_ps(qv, kv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm_storeu_ps(scores + r * stride, sums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

/* R rows' outputs, dimensions c0..c0+8w: sum over the visible keys in order of w_j v_j */
static inline __attribute__((always_inline)) void value_tile(const int R, const int W,
                                                             const float *weights, long stride,
                                                             const float *V, long v_row,
                                                             const int *index, int n, int c0,
                                                             float *const *out,
                                                             const float *inv) {
    __m256 acc[GROUP][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < W; t++) acc[r][t] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const float *vr = V + (long)index[j] * v_row + c0;
        __m256 p[GROUP];
        for (int r = 0; r < R; r++) p[r] = _mm256_broadcast_ss(weights + r * stride + j);
        for (int t = 0; t < W; t++) {
            __m256 vv = _mm256_loadu_ps(vr + 8 * t);
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(p[r], vv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 vi = _mm256_set1_ps(inv[r]);
        for (int t = 0; t < W; t++)
            _mm256_storeu_ps(out[r] + c0 + 8 * t, _mm256_mul_ps(acc[r][t], vi));
    }
}

/* the weights e^(s - max) of one row's n scores in place, zero up to a multiple of 8;
   returns 1 / their total (8 lanes in key order, then the tree of sums4) */
static float weigh(float *scores, int n) {
    const int n8 = n & ~7;
    float mx = scores[0];
    if (n8) {
        __m256 top = _mm256_loadu_ps(scores);
        for (int j = 8; j < n8; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + j));
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    }
    for (int j = n8; j < n; j++) mx = scores[j] > mx ? scores[j] : mx;
    for (int j = n; j < ((n + 7) & ~7); j++) scores[j] = -1e30f;
    __m256 total = _mm256_setzero_ps(), vmax = _mm256_set1_ps(mx);
    for (int j = 0; j < n; j += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmax));
        _mm256_storeu_ps(scores + j, e);
        total = _mm256_add_ps(total, e);
    }
    __m256 z = _mm256_setzero_ps();
    return 1.0f / _mm_cvtss_f32(sums4(total, z, z, z));
}

/* rows of heads h0..h0+R-1 (one kv head's) at query position l of sequence bi */
static void attend(const Attention *a, int bi, int h0, int R, int l) {
    const int d = a->dim, S = a->keys;
    const int kvh = h0 / (a->heads / a->kv_heads);
    const float *K = a->k + bi * a->k_batch + kvh * a->k_head;
    const float *V = a->v + bi * a->v_batch + kvh * a->v_head;
    const long stride = t_capacity;
    float *scores = t_scores;
    int *index = t_index;

    /* the visible keys, ascending: a causal row's are a prefix */
    int n = 0;
    if (!a->mask) {
        n = S - a->rows + l + 1;
        for (int j = 0; j < n; j++) index[j] = j;
    } else {
        const unsigned char *m = a->mask + bi * a->mask_batch + l * a->mask_row;
        for (int j = 0; j < S; j++)
            if (m[j]) index[n++] = j;
    }
    float *out[GROUP];
    for (int r = 0; r < R; r++)
        out[r] = a->out + bi * a->out_batch + (h0 + r) * a->out_head + l * a->out_row;
    if (n <= 0) {
        for (int r = 0; r < R; r++)
            for (int c = 0; c < d; c++) out[r][c] = 0.0f;
        return;
    }

    float qs[GROUP * MAX_DIM];
    for (int r = 0; r < R; r++) {
        const float *q = a->q + bi * a->q_batch + (h0 + r) * a->q_head + l * a->q_row;
        for (int c = 0; c < d; c++) qs[r * d + c] = q[c] * a->scale;
    }

    for (int b = 0; b < n; b += 4) {
        const float *kp[4];
        for (int i = 0; i < 4; i++)
            kp[i] = b + i < n ? K + (long)index[b + i] * a->k_row : zeros;
        switch (R) {
        case 3: score_tile(3, qs, kp, d, scores + b, stride); break;
        case 2: score_tile(2, qs, kp, d, scores + b, stride); break;
        default: score_tile(1, qs, kp, d, scores + b, stride); break;
        }
    }
    float inv[GROUP];
    for (int r = 0; r < R; r++) inv[r] = weigh(scores + r * stride, n);

    for (int c0 = 0; c0 < d; c0 += 32) {
        const int W = d - c0 < 32 ? (d - c0) / 8 : 4;
#define VALUES(R_, W_) value_tile(R_, W_, scores, stride, V, a->v_row, index, n, c0, out, inv)
        switch (R * 4 + W) {
        case 3 * 4 + 4: VALUES(3, 4); break;
        case 3 * 4 + 3: VALUES(3, 3); break;
        case 3 * 4 + 2: VALUES(3, 2); break;
        case 3 * 4 + 1: VALUES(3, 1); break;
        case 2 * 4 + 4: VALUES(2, 4); break;
        case 2 * 4 + 3: VALUES(2, 3); break;
        case 2 * 4 + 2: VALUES(2, 2); break;
        case 2 * 4 + 1: VALUES(2, 1); break;
        case 1 * 4 + 4: VALUES(1, 4); break;
        case 1 * 4 + 3: VALUES(1, 3); break;
        case 1 * 4 + 2: VALUES(1, 2); break;
        default: VALUES(1, 1); break;
        }
#undef VALUES
    }
}

typedef struct {
    const Attention *a;
    volatile int failed;
} Job;

/* tasks: (sequence, kv head, position, block of up to GROUP of its heads), split evenly by
   count */
static void attention_part(const void *arg, int part, int parts) {
    Job *job = (Job *)arg;
    const Attention *a = job->a;
    if (!reserve(a->keys)) {
        job->failed = 1;
        return;
    }
    const int group = a->heads / a->kv_heads, blocks = (group + GROUP - 1) / GROUP;
    const long total = (long)a->batch * a->kv_heads * a->rows * blocks;
    const long per = (total + parts - 1) / parts;
    const long t1 = (part + 1) * per < total ? (part + 1) * per : total;
    for (long t = part * per; t < t1; t++) {
        const int block = t % blocks, l = (t / blocks) % a->rows;
        const int kvh = (t / blocks / a->rows) % a->kv_heads;
        const int bi = t / blocks / a->rows / a->kv_heads;
        const int g0 = block * GROUP, R = group - g0 < GROUP ? group - g0 : GROUP;
        attend(a, bi, kvh * group + g0, R, l);
    }
}

/* 0 done, 1 a shape this kernel does not take, 2 out of memory */
int understudy_attention(const Attention *a) {
    if (a->batch <= 0 || a->dim <= 0 || a->dim % 8 || a->dim > MAX_DIM || a->kv_heads <= 0 ||
        a->heads % a->kv_heads || a->rows <= 0 || a->keys < a->rows)
        return 1;
    Job job = {a, 0};
    const long work = 2L * a->batch * a->heads * a->rows * a->keys * a->dim;
    understudy_parallel(attention_part, &job, work >= SPLIT_WORK ? work : 0);
    return job.failed ? 2 : 0;
}
