/*
 * Error feedback's accumulate and the step's norm in one pass:
 *
 *     out[i] = e[i] + g[i]        (out[i] = e[i] when g is NULL: a missing gradient)
 *     return sum_i out[i]^2       (in double)
 *
 * Why: the reducer needs a_t = e_t + g_t and ||a_t||^2 (the NaN/Inf check and the RMS that
 * the scale-free density controllers multiply). As two torch calls that is two passes over
 * N, and the second one re-reads the whole vector from memory. Here the square is taken
 * while a_t is still in a register.
 *
 * The sum is accumulated in double, in a fixed order for a given n (deterministic): no
 * float32 square can overflow it, and a NaN or Inf entry always makes it non-finite.
 * Loaded with ctypes (horovod_micro/accumulate.py), built into the same extension as
 * select.c.
 */
#include <stdint.h>

static double add_sumsq_portable(const float *e, const float *g, float *out, int64_t n)
{
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (int j = 0; j < 4; ++j) {
            const float a = g ? e[i + j] + g[i + j] : e[i + j];
            out[i + j] = a;
            s[j] += (double)a * (double)a;
        }
    }
    for (; i < n; ++i) {
        const float a = g ? e[i] + g[i] : e[i];
        out[i] = a;
        s[0] += (double)a * (double)a;
    }
    return (s[0] + s[1]) + (s[2] + s[3]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HVM_HAVE_AVX2_PATH 1

/* 16 floats a step: two 8-lane adds, each half widened to double for the squares. */
__attribute__((target("avx2,fma"))) static double
add_sumsq_avx2(const float *e, const float *g, float *out, int64_t n)
{
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    __m256d s2 = _mm256_setzero_pd(), s3 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_loadu_ps(e + i), a1 = _mm256_loadu_ps(e + i + 8);
        if (g) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(g + i));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(g + i + 8));
        }
        _mm256_storeu_ps(out + i, a0);
        _mm256_storeu_ps(out + i + 8, a1);
        const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(a0));
        const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(a0, 1));
        const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(a1));
        const __m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(a1, 1));
        s0 = _mm256_fmadd_pd(d0, d0, s0);
        s1 = _mm256_fmadd_pd(d1, d1, s1);
        s2 = _mm256_fmadd_pd(d2, d2, s2);
        s3 = _mm256_fmadd_pd(d3, d3, s3);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])
           + add_sumsq_portable(e + i, g ? g + i : NULL, out + i, n - i);
}
#endif

double hvm_add_sumsq(const float *e, const float *g, float *out, int64_t n)
{
#ifdef HVM_HAVE_AVX2_PATH
    static int use_avx2 = -1;
    if (use_avx2 < 0) {
        __builtin_cpu_init();
        use_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    if (use_avx2)
        return add_sumsq_avx2(e, g, out, n);
#endif
    return add_sumsq_portable(e, g, out, n);
}
