/* Math the CPU kernels share, written so that the compiler vectorizes the loops that call it. */
#ifndef PDSERVE_VECTOR_MATH_H
#define PDSERVE_VECTOR_MATH_H

#include <stdint.h>

/* exp(x) for x <= 0 within 2 ulp of expf, written so that the compiler vectorizes the loops
 * that call it (libm's expf is a call it cannot vectorize). x = n ln2 + r with |r| <= ln2/2,
 * ln2 split in two so that n ln2 is exact enough; exp(r) by the Cephes library's degree-6
 * polynomial; 2^n built in the exponent bits. fmaf everywhere, so that the reassociation the
 * build allows (-fassociative-math) cannot reorder the steps. Below -87.3 the result is
 * clamped to about 1e-38, which is 0 to every sum it enters; NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = __builtin_floorf(__builtin_fmaf(x, 1.44269504088896341f, 0.5f));
    const float r = __builtin_fmaf(n, 2.12194440e-4f, __builtin_fmaf(n, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    p = __builtin_fmaf(p * r, r, r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* silu(x) = x / (1 + exp(-x)); exp(-|x|) never overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-__builtin_fabsf(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

#endif
