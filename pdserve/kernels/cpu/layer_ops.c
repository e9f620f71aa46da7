/* The small per-layer ops of a decoder on CPU, each one pass in C instead of several torch ops.
 *
 * On a decode step the GEMMs are small, and a layer's norms, rotary embedding and cache write
 * cost more in dispatch and temporaries (a torch op each for the add, the square, the mean, the
 * rsqrt, the products, the gathers of cos and sin, the halves, the concatenation, the scatter
 * into the cache) than in arithmetic. Each function here reads its inputs once and writes its
 * outputs once. A decode step's call (a few hundred kilobytes) runs on the calling thread: that
 * is less than an OpenMP fork costs, and on a loaded machine a spinning team only steals the
 * GEMMs' cores. A prompt's (megabytes: 500 tokens are 6 MB of SwiGLU input a layer) is split
 * over the tokens, on the torch threads' team.
 *
 * Layout, in elements (float32); a "row" is one token's vector and may sit in a wider row
 * (q, k and v are column slices of one fused projection), hence the row strides.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

/* From this many elements in a call, the tokens are split over `num_threads` threads. */
enum { PARALLEL_MIN_ELEMENTS = 1 << 16 };

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
