/* The small per-layer ops of a decoder on CPU, each one pass in C instead of several torch ops.
 *
 * On a decode step the GEMMs are small, and a layer's norms, rotary embedding and cache write
 * cost more in dispatch and temporaries (a torch op each for the add, the square, the mean, the
 * rsqrt, the products, the gathers of cos and sin, the halves, the concatenation, the scatter
 * into the cache) than in arithmetic. Each function here reads its inputs once and writes its
 * outputs once. A call of a few tokens runs on the calling thread: less than an OpenMP fork
 * costs. From a decode step of 32 sequences on (SmolLM2: 18,432 floats a norm) the tokens are
 * split over the torch threads' team, which the GEMMs keep awake between calls: the inputs
 * are a GEMM's output, half of it in the other core's cache, and one thread alone spent 14 us
 * a norm and 18 a rotary write waiting for them, against 12 and 12 on two (bench/RESULTS.md).
 *
 * Layout, in elements (float32); a "row" is one token's vector and may sit in a wider row
 * (q, k and v are column slices of one fused projection), hence the row strides.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

/* From this many elements in a call, the tokens are split over `num_threads` threads. */
enum { PARALLEL_MIN_ELEMENTS = 1 << 13 };

/* sum_out[t] = x[t] + residual[t] (residual NULL: no add, sum_out unused);
 * out[t] = weight * r / sqrt(mean(r^2) + eps) where r is that sum (or x[t]).
 * out and sum_out are contiguous [num_tokens, dim]. */
void pdserve_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                      const float *weight, float *out, float *sum_out, int64_t num_tokens, int64_t dim, float eps,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_tokens * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *row = x + t * x_stride;
        float *o = out + t * dim;
        float sum_sq = 0.0f;
        if (residual != NULL) {
            const float *res = residual + t * residual_stride;
            float *s = sum_out + t * dim;
            for (int64_t i = 0; i < dim; i++) {
                const float v = row[i] + res[i];
                s[i] = v;
                sum_sq += v * v;
            }
            row = s;
        } else {
            for (int64_t i = 0; i < dim; i++) sum_sq += row[i] * row[i];
        }
        const float inv = 1.0f / sqrtf(sum_sq / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (row[i] * inv);
    }
}

/* Rotate pairs (i, i + dim/2) of one head by the position's angles (GPT-NeoX / Llama order). */
static inline void rotate_half(const float *x, float *out, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* q [num_tokens, num_heads, dim] rotated in place (row stride q_stride, heads contiguous);
 * k [num_tokens, num_kv_heads, dim] rotated into the cache and v copied there, both with row
 * stride kv_stride. cos_sin [max_pos, dim]: cos of each of the dim/2 frequencies, then sin.
 * Token t goes to block slots[t] / block_size, offset slots[t] % block_size; the caches'
 * element strides are block_stride, head_stride and token_stride. Returns -1 if a position
 * or a slot is out of range (then nothing is written), else 0. */
int pdserve_rope_write_kv(float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                          const int64_t *positions, const float *cos_sin, int64_t max_positions,
                          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                          float *k_cache, float *v_cache, int64_t num_blocks, int64_t block_stride,
                          int64_t head_stride, int64_t token_stride, const int64_t *slots, int64_t block_size,
                          int num_threads) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t pos = positions[t], slot = slots[t];
        if (pos < 0 || pos >= max_positions || slot < 0 || slot / block_size >= num_blocks) return -1;
    }
#pragma omp parallel for num_threads(num_threads) if (num_tokens * (num_heads + 2 * num_kv_heads) * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t pos = positions[t], slot = slots[t];
        const float *cos = cos_sin + pos * dim, *sin = cos + half;
        float *qt = q + t * q_stride;
        for (int64_t h = 0; h < num_heads; h++) {
            float rotated[dim];
            rotate_half(qt + h * dim, rotated, cos, sin, half);
            memcpy(qt + h * dim, rotated, (size_t)dim * sizeof(float));
        }
        const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * token_stride;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            rotate_half(k + t * kv_stride + h * dim, k_cache + base + h * head_stride, cos, sin, half);
            memcpy(v_cache + base + h * head_stride, v + t * kv_stride + h * dim, (size_t)dim * sizeof(float));
        }
    }
    return 0;
}

/* out[t] = silu(gate[t]) * up[t], silu(x) = x / (1 + exp(-x)); gate and up rows of `dim` with
 * row stride in_stride (the two halves of one fused projection), out contiguous. */
void pdserve_silu_mul(const float *gate, const float *up, int64_t in_stride, float *out, int64_t num_tokens,
                      int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_tokens * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *g = gate + t * in_stride, *u = up + t * in_stride;
        float *o = out + t * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = silu(g[i]) * u[i];
    }
}

/* out[r] = the column of row r's largest value, the first among equals, a NaN counting as the
 * largest (the first NaN), as torch.argmax: greedy sampling's pick. torch's own reads a decode
 * step's 32 x 49,152 logits at 13 GB/s. Here one pass: each of 16 lanes keeps the first largest
 * value it sees and its column, and notes a NaN; the lanes' best, the lowest column among
 * equals, is the row's. A row with a NaN (a broken model) is searched again for the first. */
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

void pdserve_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        f32x16 best = (f32x16){0} - INFINITY;
        i32x16 column = {0}, nan = {0};
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) {
            f32x16 v;
            memcpy(&v, row + c, sizeof v);
            const i32x16 more = v > best;
            best = (f32x16)(((i32x16)v & more) | ((i32x16)best & ~more));
            column = ((lane + (int32_t)c) & more) | (column & ~more);
            nan |= v != v;
        }
        float best_value = -INFINITY;
        int64_t found = 0, any_nan = 0;
        for (int i = 0; i < 16; i++) {
            any_nan |= nan[i];
            if (best[i] > best_value || (best[i] == best_value && column[i] < found)) {
                best_value = best[i];
                found = column[i];
            }
        }
        for (; c < cols; c++) {
            any_nan |= row[c] != row[c];
            if (row[c] > best_value) {
                best_value = row[c];
                found = c;
            }
        }
        if (any_nan)
            for (found = 0; row[found] == row[found]; found++) continue;
        out[r] = found;
    }
}
