/* Paged decode attention on CPU: each sequence's single query token over its cached keys
 * and values, read in place through the block table.
 *
 * The torch reference copies every block a step reads out of the cache before it can run a
 * batched matmul on it; on a CPU that copy and the second pass over the copy cost more than
 * the attention itself, since decode attention only streams memory. Here each (sequence,
 * KV head) pair walks its blocks once: the group of query heads sharing that KV head scores a
 * block's keys, and an online softmax (a running max and sum per query head) folds the
 * block's values into the output, so nothing the size of the context is ever written.
 *
 * Layout, in elements (float32):
 *   q            [num_seqs, num_heads, k_dim], heads contiguous, sequences q_stride apart (a view of
 *                the fused q/k/v projection needs no copy)
 *   k_cache      key of token t of block b, KV head h: k_cache[b*block_stride + h*head_stride + t*token_stride + i]
 *   v_cache      the same strides, first v_dim values of each row (MLA: the latent itself)
 *   block_tables [num_seqs, table_stride] int32
 *   seq_lens     [num_seqs] int32, each >= 1 and covered by the row's table
 *   out          [num_seqs, num_heads, v_dim], contiguous
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* One (sequence, KV head): `group` query heads q[group][k_dim] into out[group][v_dim].
 * `scratch` holds group * (block_size + 2 + v_dim) floats. Returns 0, or -2 when the block
 * table names a block outside the cache (out is then left unwritten). */
static int attend_one(const float *q, const float *k_base, const float *v_base, const int32_t *table,
                      int64_t seq_len, int64_t num_blocks, int64_t block_stride, int64_t token_stride,
                      int64_t block_size, int64_t group, int64_t k_dim, int64_t v_dim, float scale,
                      float *scratch, float *out) {
    float *scores = scratch;                      /* [group][block_size] */
    float *run_max = scores + group * block_size; /* [group] */
    float *run_sum = run_max + group;             /* [group] */
    float *acc = run_sum + group;                 /* [group][v_dim] */
    for (int64_t g = 0; g < group; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * group * v_dim);
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t block = table[start / block_size];
        if (block < 0 || block >= num_blocks) return -2;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        const float *keys = k_base + block * block_stride;
        const float *values = v_base + block * block_stride;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * k_dim;
            float *sg = scores + g * block_size;
            for (int64_t t = 0; t < n; t++) sg[t] = dot(qg, keys + t * token_stride, k_dim) * scale;
            float block_max = -INFINITY;
#pragma omp simd reduction(max : block_max)
            for (int64_t t = 0; t < n; t++) block_max = sg[t] > block_max ? sg[t] : block_max;
            const float new_max = block_max > run_max[g] ? block_max : run_max[g];
            /* The first block rescales the empty sums: by exp(-inf), about 0, times 0. */
            const float rescale = exp_nonpositive(run_max[g] - new_max);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                sg[t] = exp_nonpositive(sg[t] - new_max);
                sum += sg[t];
            }
            float *ag = acc + g * v_dim;
            for (int64_t i = 0; i < v_dim; i++) ag[i] *= rescale;
            for (int64_t t = 0; t < n; t++) {
                const float p = sg[t];
                const float *v = values + t * token_stride;
#pragma omp simd
                for (int64_t i = 0; i < v_dim; i++) ag[i] += p * v[i];
            }
            run_sum[g] = run_sum[g] * rescale + sum;
            run_max[g] = new_max;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int64_t i = 0; i < v_dim; i++) out[g * v_dim + i] = acc[g * v_dim + i] * inv;
    }
    return 0;
}

/* The fast path for the common head sizes (64 and 128, keys and values alike) and blocks of a
 * multiple of 16 tokens: sixteen tokens at a time, as whole 16-float vectors. The generic loop
 * above spends most of its time on one horizontal sum per (token, query head) dot product and
 * on loops whose length the compiler cannot see; here the dimensions are constants, a token's
 * 16-lane partial sums fold into one vector of 16 scores in a tree of shuffles (four levels
 * for sixteen tokens), and each query head's accumulator stays in registers while it takes a
 * block's values. GCC's vector extensions keep this portable: a machine without 512-bit
 * vectors runs each v16 operation as two or four narrower ones. */
typedef float v16 __attribute__((vector_size(64), aligned(4), __may_alias__));
typedef int32_t i16 __attribute__((vector_size(64)));

/* The fold of two vectors whose lanes hold segments of partial sums: each half of a segment
 * is added to its other half, x's segments and y's interleaved. Four levels turn a[t]
 * (token t's partial sums in all 16 lanes) into one vector whose lane t is token t's sum,
 * when level k pairs the vectors i and i + 8 / 2^k. */
static inline v16 fold_level(v16 x, v16 y, const i16 lo, const i16 hi) {
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

static inline v16 sum_lanes_of_16(v16 a[16]) {
    static const i16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const i16 hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const i16 lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    static const i16 hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    static const i16 lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    static const i16 hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    static const i16 lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    static const i16 hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) b[i] = fold_level(a[i], a[i + 8], lo1, hi1);
    for (int i = 0; i < 4; i++) c[i] = fold_level(b[i], b[i + 4], lo2, hi2);
    for (int i = 0; i < 2; i++) d[i] = fold_level(c[i], c[i + 2], lo3, hi3);
    return fold_level(d[0], d[1], lo4, hi4);
}

/* One block of 16 scores into the online softmax: lanes from `live` on are masked out, the
 * rest exponentiated against the new running max into p[16]; updates the running max and sum
 * and returns the factor that rescales what was accumulated before. While the running max is
 * still -inf (nothing seen), the factor is about 1e-38 times the empty sums: 0. */
static inline float softmax_block(v16 s, int64_t live, float *run_max, float *run_sum, float *p) {
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    if (live < 16) {
        const i16 seen = lane < (int32_t)live;
        s = (v16)(((i16)s & seen) | ((i16)((v16){0} - INFINITY) & ~seen));
    }
    __builtin_memcpy(p, &s, sizeof s);
    float block_max = -INFINITY;
    for (int t = 0; t < 16; t++) block_max = p[t] > block_max ? p[t] : block_max;
    const float new_max = block_max > *run_max ? block_max : *run_max;
    const float rescale = exp_nonpositive(*run_max - new_max);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < 16; t++) {
        p[t] = exp_nonpositive(p[t] - new_max);
        sum += p[t];
    }
    *run_sum = *run_sum * rescale + sum;
    *run_max = new_max;
    return rescale;
}

/* Prefetching: a decode reads each 16-token chunk of a block once, one head's chunk is 4 KiB
 * (head size 64), and the next chunk is in another block, far away: the hardware prefetchers,
 * which follow sequential streams, do not see it coming. With the next chunk prefetched into L1
 * alone, half of a step's attention was spent waiting for memory (0.39 ms a layer on the SmolLM2
 * shape at 32 sequences, against 0.17 with the cache hot); a second stream FAR_CHUNKS ahead into
 * L2 brought it to 0.31-0.33 (bench/RESULTS.md). Farther was slower: an item (a sequence's KV
 * head) is about a dozen chunks there. */
enum { FAR_CHUNKS = 4 };

/* The cache offset of the rows from token `token` of a sequence on (within its block), or -1
 * for a block table entry outside the cache (the caller reports that when it gets there). */
static inline int64_t rows_at(const int32_t *table, int64_t token, int64_t num_blocks, int64_t block_size,
                              int64_t block_stride, int64_t token_stride) {
    const int64_t block = table[token / block_size];
    return block >= 0 && block < num_blocks ? block * block_stride + (token % block_size) * token_stride : -1;
}

/* One token's key and value rows at `offset` from the two bases; `locality` as __builtin_prefetch's
 * (a macro, because that must be a constant). */
#define prefetch_row(keys, values, offset, K_DIM, V_DIM, locality)                     \
    do {                                                                               \
        for (int64_t i_ = 0; i_ < (K_DIM); i_ += 16) __builtin_prefetch((keys) + (offset) + i_, 0, locality);   \
        for (int64_t i_ = 0; i_ < (V_DIM); i_ += 16) __builtin_prefetch((values) + (offset) + i_, 0, locality); \
    } while (0)

/* attend_one's contract, with K_DIM and V_DIM constants (multiples of 16) and a block size of
 * a multiple of 16. `scratch` holds group * (2 + v_dim) floats. */
static inline __attribute__((always_inline)) int attend_one_16(
    const float *q, const float *k_base, const float *v_base, const int32_t *table, int64_t seq_len,
    int64_t num_blocks, int64_t block_stride, int64_t token_stride, int64_t block_size, int64_t group,
    float scale, float *scratch, float *out, const int64_t K_DIM, const int64_t V_DIM) {
    enum { W = 16 };
    const int64_t kc = K_DIM / W, vc = V_DIM / W;
    float *run_max = scratch, *run_sum = scratch + group;
    v16 *acc = (v16 *)(scratch + 2 * group); /* [group][vc] */
    for (int64_t g = 0; g < group; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
        for (int64_t c = 0; c < vc; c++) acc[g * vc + c] = (v16){0};
    }
    for (int64_t start = 0; start < seq_len; start += W) {
        const int64_t in_block = start % block_size;
        const int64_t block = table[start / block_size];
        if (block < 0 || block >= num_blocks) return -2;
        const int64_t n = seq_len - start < W ? seq_len - start : W;
        const float *keys = k_base + block * block_stride + in_block * token_stride;
        const float *values = v_base + block * block_stride + in_block * token_stride;
        /* The rows 16 tokens on go to L1 while the first query head works, those FAR_CHUNKS * 16
         * on to L2 while the second one does (the first, when it is alone). */
        const int64_t near = start + W < seq_len ? rows_at(table, start + W, num_blocks, block_size, block_stride, token_stride) : -1;
        const int64_t far = start + FAR_CHUNKS * W < seq_len
            ? rows_at(table, start + FAR_CHUNKS * W, num_blocks, block_size, block_stride, token_stride) : -1;
        for (int64_t g = 0; g < group; g++) {
            const v16 *qg = (const v16 *)(q + g * K_DIM);
            v16 a[W];
            for (int64_t t = 0; t < W; t++) {
                if (g == 0 && near >= 0) prefetch_row(k_base + near, v_base + near, t * token_stride, K_DIM, V_DIM, 3);
                if ((g == 1 || group == 1) && far >= 0) prefetch_row(k_base + far, v_base + far, t * token_stride, K_DIM, V_DIM, 2);
                v16 sum = {0};
                if (t < n) { /* rows past the context may hold anything, NaN included */
                    const v16 *k = (const v16 *)(keys + t * token_stride);
                    for (int64_t c = 0; c < kc; c++) sum += qg[c] * k[c];
                }
                a[t] = sum;
            }
            float p[W];
            const float rescale = softmax_block(sum_lanes_of_16(a) * scale, n, &run_max[g], &run_sum[g], p);
            v16 out_acc[V_DIM / W];
            for (int64_t c = 0; c < vc; c++) out_acc[c] = acc[g * vc + c] * rescale;
            for (int64_t t = 0; t < n; t++) {
                const v16 *v = (const v16 *)(values + t * token_stride);
                for (int64_t c = 0; c < vc; c++) out_acc[c] += p[t] * v[c];
            }
            for (int64_t c = 0; c < vc; c++) acc[g * vc + c] = out_acc[c];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / run_sum[g];
        v16 *o = (v16 *)(out + g * V_DIM);
        for (int64_t c = 0; c < vc; c++) o[c] = acc[g * vc + c] * inv;
    }
    return 0;
}

typedef int (*attend_fn)(const float *, const float *, const float *, const int32_t *, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *, float *);

#define FIXED_ATTEND(D)                                                                                    \
    static int attend_##D(const float *q, const float *k_base, const float *v_base, const int32_t *table,  \
                          int64_t seq_len, int64_t num_blocks, int64_t block_stride, int64_t token_stride, \
                          int64_t block_size, int64_t group, int64_t k_dim, int64_t v_dim, float scale,    \
                          float *scratch, float *out) {                                                    \
        (void)k_dim, (void)v_dim;                                                                          \
        return attend_one_16(q, k_base, v_base, table, seq_len, num_blocks, block_stride, token_stride,    \
                             block_size, group, scale, scratch, out, D, D);                                \
    }
FIXED_ATTEND(64)
FIXED_ATTEND(128)

/* The fast path where one fits the shape, else the generic loop. */
static attend_fn choose_attend(int64_t k_dim, int64_t v_dim, int64_t block_size) {
    if (block_size % 16 == 0 && k_dim == v_dim && k_dim == 64) return attend_64;
    if (block_size % 16 == 0 && k_dim == v_dim && k_dim == 128) return attend_128;
    return attend_one;
}

/* Returns 0; -1 when scratch memory could not be allocated; -2 when a block table entry is
 * outside [0, num_blocks). On an error `out` is incomplete. */
int pdserve_paged_decode(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                         int64_t num_blocks, int64_t block_stride, int64_t head_stride, int64_t token_stride,
                         const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                         int64_t k_dim, int64_t v_dim, float scale, float *out, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t items = num_seqs * num_kv_heads;
    const attend_fn attend = choose_attend(k_dim, v_dim, block_size);
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * group * (block_size + 2 + v_dim));
        if (scratch == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (scratch == NULL) continue;
            const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int64_t first_head = seq * num_heads + kv_head * group;
            const int rc = attend(q + seq * q_stride + kv_head * group * k_dim, k_cache + kv_head * head_stride,
                                      v_cache + kv_head * head_stride, block_tables + seq * table_stride,
                                      seq_lens[seq], num_blocks, block_stride, token_stride, block_size, group,
                                      k_dim, v_dim, scale, scratch, out + first_head * v_dim);
            if (rc != 0) {
#pragma omp atomic write
                status = rc;
            }
        }
        free(scratch);
    }
    return status;
}

/* ---- Prompts: a query per token ------------------------------------------------------------
 * A prompt (or a chunk of one) has a query per token, each over the context up to and
 * including its own position. One work item is (sequence, KV head, a tile of up to
 * QUERY_TILE query tokens). The item first copies the keys its queries can see into panels of
 * 16 keys, transposed ([dim][16]): a query row's 16 scores are then one vector FMA per
 * dimension, with no horizontal sums, and ROWS query rows (token x query head of the group)
 * share each load of the panel. Two panels at a time, so that each broadcast of a query
 * element feeds two FMAs. The copy costs one pass over the visible keys per tile, a few
 * percent of the tile's arithmetic.
 *
 * A group of ROWS rows then keeps its whole rows of scores (ROWS x context floats, in L2 at
 * any context the engine takes) rather than an online softmax: one max and one sum per row
 * instead of two horizontal reductions and a rescale of the accumulators every 16 keys, which
 * cost as much as the dot products. The values are read in place, block by block, into
 * PV_ROWS x PV_COLS accumulator vectors: all of them, the value vectors and the broadcast
 * probabilities fit the 32 vector registers, where ROWS x D/16 accumulators would not. */
enum { PANEL = 16, ROWS = 8, QUERY_TILE = 64, PV_ROWS = 4, PV_COLS = 4 };

/* Row `row` of scores into probabilities over its first n keys, 0 from there to max_limit (the
 * row holds whole vectors of 16 up to that); returns 1 / their sum, left out of the row. Whole
 * vectors with the lanes past n masked, and no OpenMP reductions: GCC's kept their partial
 * results on the stack, and the scalar stores and vector loads there stalled every row. */
static inline float softmax_row(float *row, int64_t n, int64_t max_limit, float scale) {
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 minus_inf = (v16){0} - INFINITY;
    const int64_t whole = (n + PANEL - 1) / PANEL * PANEL;
    v16 vmax = minus_inf;
    for (int64_t t = 0; t < whole; t += PANEL) {
        v16 x;
        __builtin_memcpy(&x, row + t, sizeof x);
        const i16 seen = lane < (int32_t)(n - t);
        x = (v16)(((i16)x & seen) | ((i16)minus_inf & ~seen));
        const i16 more = x > vmax;
        vmax = (v16)(((i16)x & more) | ((i16)vmax & ~more));
    }
    float lanes[PANEL], row_max = -INFINITY;
    __builtin_memcpy(lanes, &vmax, sizeof vmax);
    for (int i = 0; i < PANEL; i++) row_max = lanes[i] > row_max ? lanes[i] : row_max;
    v16 vsum = {0};
    for (int64_t t = 0; t < whole; t += PANEL) {
        float e[PANEL];
        for (int i = 0; i < PANEL; i++) e[i] = t + i < n ? exp_nonpositive((row[t + i] - row_max) * scale) : 0.0f;
        v16 x;
        __builtin_memcpy(&x, e, sizeof x);
        __builtin_memcpy(row + t, &x, sizeof x);
        vsum += x;
    }
    for (int64_t t = whole; t < max_limit; t++) row[t] = 0.0f;
    __builtin_memcpy(lanes, &vsum, sizeof vsum);
    float sum = 0.0f;
    for (int i = 0; i < PANEL; i++) sum += lanes[i];
    return 1.0f / sum;
}

/* One item. q rows: (token row, head) at row * q_stride + head * D; out rows at
 * ((row * num_heads) + head) * D. The tile's tokens are the sequence's query tokens
 * [tok0, tok0 + ntok), the first of them at token row q_row0 + tok0 and position
 * first_pos + tok0. `panels` holds ceil(seq_len / 16) * 16 * D floats, `scores` ROWS times
 * ceil(seq_len / 16) * 16. Returns 0, or -2 for a block table entry outside the cache. */
static inline __attribute__((always_inline)) int prefill_tile(
    const float *q, int64_t q_stride, float *out, int64_t num_heads, const float *k_base, const float *v_base,
    const int32_t *table, int64_t num_blocks, int64_t block_stride, int64_t token_stride, int64_t block_size,
    int64_t first_pos, int64_t q_row0, int64_t tok0, int64_t ntok, int64_t head0, int64_t group, float scale,
    float *panels, float *scores, const int64_t D) {
    const int64_t num_keys = first_pos + tok0 + ntok;
    const int64_t stride = (num_keys + PANEL - 1) / PANEL * PANEL; /* of a row of scores */
    for (int64_t start = 0; start < num_keys; start += block_size) {
        const int64_t block = table[start / block_size];
        if (block < 0 || block >= num_blocks) return -2;
        const int64_t n = num_keys - start < block_size ? num_keys - start : block_size;
        for (int64_t t = 0; t < n; t++) {
            const int64_t key = start + t;
            float *lane = panels + key / PANEL * D * PANEL + key % PANEL;
            const float *k = k_base + block * block_stride + t * token_stride;
            for (int64_t d = 0; d < D; d++) lane[d * PANEL] = k[d];
        }
    }
    for (int64_t key = num_keys; key < stride; key++) { /* the last panel's lanes past the keys */
        float *lane = panels + key / PANEL * D * PANEL + key % PANEL;
        for (int64_t d = 0; d < D; d++) lane[d * PANEL] = 0.0f;
    }
    const int64_t num_rows = ntok * group;
    for (int64_t r0 = 0; r0 < num_rows; r0 += ROWS) {
        const int64_t live = num_rows - r0 < ROWS ? num_rows - r0 : ROWS;
        const float *qr[ROWS];
        int64_t limit[ROWS], max_limit = 0;
        for (int64_t r = 0; r < ROWS; r++) { /* a short last group repeats its last row, unwritten */
            const int64_t row = r0 + (r < live ? r : live - 1), token = tok0 + row / group;
            qr[r] = q + (q_row0 + token) * q_stride + (head0 + row % group) * D;
            limit[r] = first_pos + token + 1;
            max_limit = limit[r] > max_limit ? limit[r] : max_limit;
        }
        int64_t base = 0;
        for (; base + PANEL < max_limit; base += 2 * PANEL) { /* two panels: each broadcast feeds two FMAs */
            const v16 *panel = (const v16 *)(panels + base * D), *next = panel + D;
            v16 s[ROWS], s1[ROWS];
            for (int64_t r = 0; r < ROWS; r++) s[r] = s1[r] = (v16){0};
            for (int64_t d = 0; d < D; d++) {
                const v16 kt = panel[d], kt1 = next[d];
                for (int64_t r = 0; r < ROWS; r++) {
                    const float x = qr[r][d];
                    s[r] += x * kt;
                    s1[r] += x * kt1;
                }
            }
            for (int64_t r = 0; r < ROWS; r++) {
                __builtin_memcpy(scores + r * stride + base, &s[r], sizeof s[r]);
                __builtin_memcpy(scores + r * stride + base + PANEL, &s1[r], sizeof s1[r]);
            }
        }
        if (base < max_limit) {
            const v16 *panel = (const v16 *)(panels + base * D);
            v16 s[ROWS];
            for (int64_t r = 0; r < ROWS; r++) s[r] = (v16){0};
            for (int64_t d = 0; d < D; d++) {
                const v16 kt = panel[d];
                for (int64_t r = 0; r < ROWS; r++) s[r] += qr[r][d] * kt;
            }
            for (int64_t r = 0; r < ROWS; r++) __builtin_memcpy(scores + r * stride + base, &s[r], sizeof s[r]);
        }
        /* Row r's probabilities over its keys [0, limit[r]); 0 from there to max_limit, so that
         * the rows share one walk over the values. Every row sees key 0. */
        float inv_sum[ROWS];
        for (int64_t r = 0; r < ROWS; r++) inv_sum[r] = softmax_row(scores + r * stride, limit[r], max_limit, scale);
        /* Only keys inside the context: rows past it may hold anything, NaN included. */
        for (int64_t rg = 0; rg < live; rg += PV_ROWS) {
            const float *prob = scores + rg * stride;
            for (int64_t c0 = 0; c0 < D / PANEL; c0 += PV_COLS) {
                v16 acc[PV_ROWS][PV_COLS];
                for (int64_t r = 0; r < PV_ROWS; r++)
                    for (int64_t c = 0; c < PV_COLS; c++) acc[r][c] = (v16){0};
                for (int64_t start = 0; start < max_limit; start += block_size) {
                    const int64_t n = max_limit - start < block_size ? max_limit - start : block_size;
                    const float *values = v_base + table[start / block_size] * block_stride + c0 * PANEL;
                    for (int64_t t = 0; t < n; t++) {
                        const v16 *v = (const v16 *)(values + t * token_stride);
                        v16 p[PV_ROWS]; /* broadcast once; then each value vector is loaded once */
                        for (int64_t r = 0; r < PV_ROWS; r++) p[r] = (v16){0} + prob[r * stride + start + t];
                        for (int64_t c = 0; c < PV_COLS; c++) {
                            v16 vc = v[c];
#ifdef __AVX512F__
                            /* In a register: GCC would load it again for every row. Without
                             * AVX-512 a v16 spans two registers, which no constraint names. */
                            __asm__("" : "+v"(vc));
#endif
                            for (int64_t r = 0; r < PV_ROWS; r++) acc[r][c] += p[r] * vc;
                        }
                    }
                }
                for (int64_t r = 0; r < PV_ROWS && rg + r < live; r++) {
                    const int64_t row = r0 + rg + r, token = tok0 + row / group;
                    v16 *o = (v16 *)(out + ((q_row0 + token) * num_heads + head0 + row % group) * D) + c0;
                    for (int64_t c = 0; c < PV_COLS; c++) o[c] = acc[r][c] * inv_sum[rg + r];
                }
            }
        }
    }
    return 0;
}

#define PREFILL_TILE(D)                                                                                          \
    static int prefill_tile_##D(const float *q, int64_t q_stride, float *out, int64_t num_heads,                \
                                const float *k_base, const float *v_base, const int32_t *table, int64_t num_blocks, \
                                int64_t block_stride, int64_t token_stride, int64_t block_size, int64_t first_pos, \
                                int64_t q_row0, int64_t tok0, int64_t ntok, int64_t head0, int64_t group,        \
                                float scale, float *panels, float *scores) {                                     \
        return prefill_tile(q, q_stride, out, num_heads, k_base, v_base, table, num_blocks, block_stride,       \
                            token_stride, block_size, first_pos, q_row0, tok0, ntok, head0, group, scale, panels,  \
                            scores, D);                                                                          \
    }
PREFILL_TILE(64)
PREFILL_TILE(128)

/* Every query token of `num_seqs` sequences: sequence s has the query rows
 * [query_start[s], query_start[s + 1]) of q (rows q_stride apart, heads contiguous) and of
 * out, the last tokens of its context of seq_lens[s], already in the cache. Head sizes 64 and
 * 128 (keys and values alike), blocks of a multiple of 16 tokens. Returns 0; -1 out of
 * memory; -2 a block table entry outside the cache; -3 a shape this kernel does not take. */
int pdserve_paged_prefill(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          int64_t num_blocks, int64_t block_stride, int64_t head_stride, int64_t token_stride,
                          const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                          const int32_t *query_start, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t block_size, int64_t head_dim, int64_t max_seq_len, float scale, float *out,
                          int num_threads) {
    if ((head_dim != 64 && head_dim != 128) || block_size % PANEL != 0 || num_heads % num_kv_heads != 0) return -3;
    const int64_t group = num_heads / num_kv_heads;
    int64_t *first_item = malloc(sizeof(int64_t) * (num_seqs + 1)); /* sequence s: items [first_item[s], ...) */
    if (first_item == NULL) return -1;
    first_item[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t qlen = query_start[s + 1] - query_start[s];
        first_item[s + 1] = first_item[s] + (qlen + QUERY_TILE - 1) / QUERY_TILE * num_kv_heads;
    }
    const int64_t items = first_item[num_seqs];
    const int64_t padded_len = (max_seq_len + PANEL - 1) / PANEL * PANEL;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *panels = malloc(sizeof(float) * padded_len * (head_dim + ROWS));
        float *scores = panels + padded_len * head_dim;
        if (panels == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (panels == NULL) continue;
            int64_t s = 0;
            while (first_item[s + 1] <= item) s++;
            const int64_t index = item - first_item[s], tile = index / num_kv_heads, kv_head = index % num_kv_heads;
            const int64_t qlen = query_start[s + 1] - query_start[s], tok0 = tile * QUERY_TILE;
            const int64_t ntok = qlen - tok0 < QUERY_TILE ? qlen - tok0 : QUERY_TILE;
            const int64_t first_pos = seq_lens[s] - qlen;
            const float *k_base = k_cache + kv_head * head_stride, *v_base = v_cache + kv_head * head_stride;
            const int32_t *table = block_tables + s * table_stride;
            const int rc = head_dim == 64
                ? prefill_tile_64(q, q_stride, out, num_heads, k_base, v_base, table, num_blocks, block_stride,
                                  token_stride, block_size, first_pos, query_start[s], tok0, ntok, kv_head * group,
                                  group, scale, panels, scores)
                : prefill_tile_128(q, q_stride, out, num_heads, k_base, v_base, table, num_blocks, block_stride,
                                   token_stride, block_size, first_pos, query_start[s], tok0, ntok, kv_head * group,
                                   group, scale, panels, scores);
            if (rc != 0) {
#pragma omp atomic write
                status = rc;
            }
        }
        free(panels);
    }
    free(first_item);
    return status;
}
