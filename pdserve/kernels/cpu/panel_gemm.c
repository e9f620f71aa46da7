/* A linear layer's GEMM, y = x · Wᵀ (+ bias), on weights packed once into 32-column panels.
 *
 * W [N, K] is stored as panels [ceil(N / 32)][K][32]: panel j holds output columns 32j..32j+31,
 * one 128-byte row per k, so a panel streams from memory in order. A pass runs up to 14 rows of
 * x against one panel with 28 vector accumulators (14 rows x 2 x 16 columns): per k, two loads
 * of the panel and 14 broadcasts of x feed 28 FMAs.
 *
 * Why not oneDNN's GEMM: with a decode step's few rows it ran at 313 GFLOPS (32 rows) where
 * it reaches ~450 with 2048, as if the weights' trip from memory and the arithmetic did not
 * overlap. Here, when a panel takes several passes (more than 14 rows), the later passes
 * prefetch the next panel into L2 while they compute on the current one from cache, and a
 * lone pass prefetches the next panel itself, so that two panels' reads are in flight. On
 * SmolLM2's layers this is 1.1-1.4x oneDNN's speed from 1 to 128 rows (1.38x at 32) and 0.98x
 * of it at 2048. The FMA peak here is ~520 GFLOPS on two cores: the GEMM reaches 85-87% of it
 * at 32 rows with the weights from memory, 90-95% at 2048 (bench/RESULTS.md).
 * Rows are taken in chunks of 128, so that a chunk of x stays in L2 while the panels stream.
 *
 * The output columns are split over `num_threads` threads, each a contiguous range of panels.
 * The last panel is zero-padded past N; its stores are masked.
 *
 * Gated (SwiGLU's gate and up projections, one GEMM): each panel holds 16 gate columns and the
 * same 16 up columns, and a pass stores silu(gate) * up, 16 output columns, straight from its
 * accumulators. The [M, 2N] projection is never written nor read back, and the activation is
 * no separate pass over memory.
 */
#include <stdint.h>

#include "vector_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX512F__
#include <immintrin.h>

enum { PANEL = 32, GATED_COLUMNS = 16, MAX_ROWS = 14, ROW_CHUNK = 128 };

int pdserve_panel_gemm_available(void) { return 1; }

/* y[i] = silu(gate[i]) * up[i] for the columns in `mask`: the formula of layer_ops.c's silu_mul. */
static void store_silu_mul(float *y, __mmask16 mask, __m512 gate, __m512 up) {
    float g[16], u[16], out[16];
    _mm512_storeu_ps(g, gate);
    _mm512_storeu_ps(u, up);
    for (int i = 0; i < 16; i++) out[i] = silu(g[i]) * u[i];
    _mm512_mask_storeu_ps(y, mask, _mm512_loadu_ps(out));
}

/* One pass: `R` rows against one panel over all of K. `next`, when not NULL, is a range of
 * `next_lines` cache lines of the next panel to prefetch, `per_k` lines a step of k. Gated, the
 * panel's halves are gate and up, and m0 masks the 16 output columns. */
#define PASS(R)                                                                                            \
    static void pass_##R(const float *x, int64_t ldx, const float *panel, int64_t K, float *y, int64_t ldy, \
                         const float *bias, const float *bias_up, __mmask16 m0, __mmask16 m1, const char *next,  \
                         int64_t next_lines,                                                               \
                         int per_k, int gated) {                                                           \
        __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();                        \
        __m512 b1 = bias_up ? _mm512_maskz_loadu_ps(m1, bias_up) : _mm512_setzero_ps();                  \
        __m512 acc[R][2];                                                                                  \
        for (int r = 0; r < R; r++) {                                                                      \
            acc[r][0] = b0;                                                                                \
            acc[r][1] = b1;                                                                                \
        }                                                                                                  \
        /* Pointers that step with k: indexed as x[r * ldx + k], GCC kept the rows' offsets on the   \
         * stack and reloaded them every step, which cost 3-11% of the GEMM (bench/RESULTS.md). */   \
        const float *xk = x, *pk = panel;                                                                  \
        for (int64_t k = 0; k < K; k++, xk++, pk += PANEL) {                                               \
            if (next != NULL) {                                                                            \
                for (int q = 0; q < per_k; q++) {                                                          \
                    const int64_t line = k * per_k + q;                                                    \
                    if (line < next_lines) _mm_prefetch(next + line * 64, _MM_HINT_T1);                    \
                }                                                                                          \
            }                                                                                              \
            const __m512 w0 = _mm512_loadu_ps(pk), w1 = _mm512_loadu_ps(pk + 16);                         \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                         \
                const __m512 a = _mm512_set1_ps(xk[r * ldx]);                                              \
                acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);                                             \
                acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);                                             \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < R; r++) {                                                                      \
            if (gated) {                                                                                   \
                store_silu_mul(y + r * ldy, m0, acc[r][0], acc[r][1]);                                     \
            } else {                                                                                       \
                _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);                                         \
                _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);                                    \
            }                                                                                              \
        }                                                                                                  \
    }
PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8) PASS(9) PASS(10) PASS(11) PASS(12) PASS(13) PASS(14)

typedef void (*pass_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *, const float *,
                        __mmask16,
                        __mmask16, const char *, int64_t, int, int);
static const pass_fn PASSES[MAX_ROWS + 1] = {
    NULL, pass_1, pass_2, pass_3, pass_4, pass_5, pass_6, pass_7, pass_8, pass_9, pass_10, pass_11, pass_12, pass_13, pass_14,
};

static __mmask16 columns_mask(int64_t columns) {
    return columns >= 16 ? (__mmask16)0xFFFF : columns <= 0 ? (__mmask16)0 : (__mmask16)((1u << columns) - 1);
}

/* x [M, K] with rows `ldx` apart; panels as above; y [M, N] contiguous. bias [N] or NULL; gated,
 * N is the output's width and bias [2N] (gate's, then up's) or NULL. */
void pdserve_panel_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panels, int64_t N,
                        const float *bias, float *y, int num_threads, int gated) {
    const int64_t columns = gated ? GATED_COLUMNS : PANEL; /* output columns a panel yields */
    const int64_t num_panels = (N + columns - 1) / columns;
    const int64_t lines = K * PANEL * (int64_t)sizeof(float) / 64;
#pragma omp parallel num_threads(num_threads)
    {
        int thread = 0, threads = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        const int64_t first = num_panels * thread / threads, last = num_panels * (thread + 1) / threads;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
            const int64_t rows = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
            const int64_t passes = (rows + MAX_ROWS - 1) / MAX_ROWS;
            const int64_t rows_per_pass = (rows + passes - 1) / passes;
            /* Passes after the first share the next panel's lines between them; a lone pass
             * prefetches the next panel itself, so that two panels' reads are in flight. */
            const int64_t prefetchers = passes > 1 ? passes - 1 : 1;
            const int64_t share = (lines + prefetchers - 1) / prefetchers;
            const int per_k = (int)((share + K - 1) / K);
            for (int64_t j = first; j < last; j++) {
                const float *panel = panels + j * K * PANEL;
                const char *next = j + 1 < last ? (const char *)(panels + (j + 1) * K * PANEL) : NULL;
                const __mmask16 m0_mask = columns_mask(N - j * columns);
                const __mmask16 m1_mask = gated ? m0_mask : columns_mask(N - j * PANEL - 16);
                const float *b = bias ? bias + j * columns : NULL;
                const float *b_up = bias ? (gated ? bias + N + j * columns : b + 16) : NULL;
                int64_t pass = 0;
                for (int64_t r = 0; r < rows; r += rows_per_pass, pass++) {
                    const int64_t n = rows - r < rows_per_pass ? rows - r : rows_per_pass;
                    const int64_t part = passes > 1 ? pass - 1 : 0;
                    const char *prefetch = (pass > 0 || passes == 1) && next != NULL ? next + part * share * 64 : NULL;
                    const int64_t left = lines - part * share;
                    PASSES[n](x + (m0 + r) * ldx, ldx, panel, K, y + (m0 + r) * N + j * columns, N, b, b_up, m0_mask,
                              m1_mask, prefetch, prefetch ? (share < left ? share : left) : 0, per_k, gated);
                }
            }
        }
    }
}
#else
int pdserve_panel_gemm_available(void) { return 0; }

void pdserve_panel_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panels, int64_t N,
                        const float *bias, float *y, int num_threads, int gated) {
    (void)x, (void)M, (void)K, (void)ldx, (void)panels, (void)N, (void)bias, (void)y, (void)num_threads, (void)gated;
}
#endif
