/*
 * Threshold selection in one read pass (MiCRO's "no sort, no top-k" selection).
 *
 * hvm_select_abs_ge writes base + i for every i in [0, n) with |x[i]| >= t into out
 * (at most cap entries, in ascending order) and returns how many there are in all, so a
 * caller whose buffer was too small learns the size it needs. NaN never compares >= t.
 * hvm_select_abs_ge_values does the same and also writes x[i] into vals (when vals is not
 * NULL): the caller then has the selected values without a second, random-access gather
 * from a part far larger than the cache (the density controller's ladder search reads
 * them).
 *
 * Why native: torch needs three passes with temporaries (abs, compare, nonzero) and runs
 * 10-30x slower than reading the floats once. Here the data is read once: on x86-64 with
 * AVX2 (checked at run time) 32 floats are compared per step and hits are pulled out of
 * the lane masks; elsewhere a portable body OR-reduces blocks of BLOCK floats (a loop the
 * compiler vectorises) and rescans only blocks with a hit, from L1. At densities <= 1 %
 * most steps have no hit, so the cost stays close to one read of the data.
 *
 * Loaded with ctypes (horovod_micro/selection.py); the Python module stub below only lets
 * setuptools build and install it like any extension.
 */
#include <Python.h>
#include <math.h>
#include <stdint.h>

#define BLOCK 32
/* Software prefetch distance, in floats (8 KB ahead): without it the hardware prefetcher
 * alone leaves the AVX2 loop well behind one plain read of a cold part larger than the
 * cache (BENCHMARKS.md, "Selection cost"). -DPREFETCH_AHEAD=0 builds it without. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2048
#endif
#if PREFETCH_AHEAD > 0
#define HVM_PREFETCH(p) __builtin_prefetch(p)
#else
#define HVM_PREFETCH(p) ((void)0)
#endif

/* Portable body: OR-reduce a block (vectorised by the compiler), rescan only blocks with a
 * hit, compacting without a data-dependent branch. */
static int64_t select_portable(const float *x, int64_t n, float t, int64_t base, int32_t *out,
                               float *vals, int64_t cap)
{
    int64_t count = 0;
    int64_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        HVM_PREFETCH(x + i + PREFETCH_AHEAD);
        int hit = 0;
        for (int j = 0; j < BLOCK; ++j)
            hit |= fabsf(x[i + j]) >= t;
        if (!hit)
            continue;
        if (count + BLOCK <= cap) {
            for (int j = 0; j < BLOCK; ++j) {
                out[count] = (int32_t)(base + i + j);
                if (vals)
                    vals[count] = x[i + j];
                count += fabsf(x[i + j]) >= t;
            }
            continue;
        }
        for (int j = 0; j < BLOCK; ++j) {
            if (fabsf(x[i + j]) >= t) {
                if (count < cap) {
                    out[count] = (int32_t)(base + i + j);
                    if (vals)
                        vals[count] = x[i + j];
                }
                ++count;
            }
        }
    }
    for (; i < n; ++i) {
        if (fabsf(x[i]) >= t) {
            if (count < cap) {
                out[count] = (int32_t)(base + i);
                if (vals)
                    vals[count] = x[i];
            }
            ++count;
        }
    }
    return count;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HVM_HAVE_AVX2_PATH 1

/* Whether this CPU runs the AVX2 bodies (checked once). */
static int have_avx2(void)
{
    static int avx2 = -1;
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi");
    }
    return avx2;
}

/* AVX2 body: 32 floats per step as four 8-lane compares; a step without a hit costs one
 * predictable branch; hits are extracted from the lane masks with count-trailing-zeros. */
__attribute__((target("avx2,bmi"))) static int64_t
select_avx2(const float *x, int64_t n, float t, int64_t base, int32_t *out, float *vals,
            int64_t cap)
{
    const __m256 thr = _mm256_set1_ps(t);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t count = 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        HVM_PREFETCH(x + i + PREFETCH_AHEAD);
        HVM_PREFETCH(x + i + PREFETCH_AHEAD + 16);
        /* _CMP_GE_OQ is false for NaN, like the portable body. */
        unsigned m0 = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(
            _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), thr, _CMP_GE_OQ));
        unsigned m1 = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(
            _mm256_and_ps(_mm256_loadu_ps(x + i + 8), abs_mask), thr, _CMP_GE_OQ));
        unsigned m2 = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(
            _mm256_and_ps(_mm256_loadu_ps(x + i + 16), abs_mask), thr, _CMP_GE_OQ));
        unsigned m3 = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(
            _mm256_and_ps(_mm256_loadu_ps(x + i + 24), abs_mask), thr, _CMP_GE_OQ));
        uint32_t m = m0 | (m1 << 8) | (m2 << 16) | (m3 << 24);
        if (!m)
            continue;
        while (m) {
            int j = __builtin_ctz(m);
            if (count < cap) {
                out[count] = (int32_t)(base + i + j);
                if (vals)
                    vals[count] = x[i + j];
            }
            ++count;
            m &= m - 1;
        }
    }
    const int64_t used = count < cap ? count : cap;
    return count + select_portable(x + i, n - i, t, base + i, out + used,
                                   vals ? vals + used : NULL, cap - used);
}
#endif

int64_t hvm_select_abs_ge_values(const float *x, int64_t n, float t, int64_t base,
                                 int32_t *out, float *vals, int64_t cap)
{
#ifdef HVM_HAVE_AVX2_PATH
    if (have_avx2())
        return select_avx2(x, n, t, base, out, vals, cap);
#endif
    return select_portable(x, n, t, base, out, vals, cap);
}

int64_t hvm_select_abs_ge(const float *x, int64_t n, float t, int64_t base, int32_t *out,
                          int64_t cap)
{
    return hvm_select_abs_ge_values(x, n, t, base, out, NULL, cap);
}

/*
 * Drift-weighted selection (MiCRO's default judge). Each coordinate i carries a 16-bit
 * stamp of the iteration after which its residual last started from zero, last[i] (every
 * rank holds the same array: it follows the gathered indices). Its age is
 * (now - last[i]) mod 2^16, at least 1 (the caller keeps true ages below 2^16), and its
 * score |x[i]| * sqrt(wait / age): the accumulation measured against how long it has been
 * accumulating, so a coordinate whose gradient keeps one sign (a real drift) scores above
 * one whose accumulation is a random walk of the same size. Selected: score >= t, with
 * score computed as fabsf(x) * sqrtf(wait / age) in float (the definition the simulations
 * state). The pass over the part compares without a square root,
 * x^2 * wait >= t^2 * age, loosened by a few ulps so that it never misses an entry the
 * definition selects; only those candidates get the exact score. Writes base + i and,
 * when vals is not NULL, the signed score x[i] * sqrt(wait / age) (the values the density
 * controller's ladder counts among). One read of x (4 bytes) and of last (2 bytes) per
 * coordinate; on x86-64 with AVX2, 32 coordinates per step in lanes, as the magnitude
 * kernel; same contract as hvm_select_abs_ge_values otherwise.
 */
static inline int drift_keep(float x, float age, float wait, float t, int64_t i, int64_t base,
                             int32_t *out, float *vals, int64_t cap, int64_t *count)
{
    const float w = sqrtf(wait / age);
    if (!(fabsf(x) * w >= t))
        return 0;
    if (*count < cap) {
        out[*count] = (int32_t)(base + i);
        if (vals)
            vals[*count] = x * w;
    }
    ++*count;
    return 1;
}

static inline float age16(uint32_t now16, uint16_t last)
{
    return (float)((now16 - (uint32_t)last) & 0xffffu);
}

static int64_t drift_portable(const float *x, const uint16_t *last, uint32_t now16,
                              float wait, int64_t n, float t, int64_t base, int32_t *out,
                              float *vals, int64_t cap, int64_t count)
{
    const float loose = t * t * (1.0f - 1e-6f);
    int64_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        HVM_PREFETCH(x + i + PREFETCH_AHEAD);
        HVM_PREFETCH(last + i + PREFETCH_AHEAD);
        int hit = 0;
        for (int j = 0; j < BLOCK; ++j)
            hit |= x[i + j] * x[i + j] * wait >= loose * age16(now16, last[i + j]);
        if (!hit)
            continue;
        for (int j = 0; j < BLOCK; ++j) {
            const float age = age16(now16, last[i + j]);
            if (x[i + j] * x[i + j] * wait >= loose * age)
                drift_keep(x[i + j], age, wait, t, i + j, base, out, vals, cap, &count);
        }
    }
    for (; i < n; ++i) {
        const float age = age16(now16, last[i]);
        if (x[i] * x[i] * wait >= loose * age)
            drift_keep(x[i], age, wait, t, i, base, out, vals, cap, &count);
    }
    return count;
}

#ifdef HVM_HAVE_AVX2_PATH
/* The ages of 8 lanes, widened from their 16-bit stamps, as floats. */
__attribute__((target("avx2"))) static inline __m256
lane_ages(const uint16_t *last, __m256i now_v)
{
    const __m256i stamps = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)last));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_sub_epi32(now_v, stamps),
                                               _mm256_set1_epi32(0xffff)));
}

/* 8 lanes: x^2 * wait >= loose * age, as a bit mask. The values and ages are loaded again
 * by drift_exact8 for the rare group with a candidate: cheaper than keeping four groups'
 * registers across the loop, which spills them to the stack on every step. */
__attribute__((target("avx2"))) static inline unsigned
drift_lanes(const float *x, const uint16_t *last, __m256i now_v, __m256 wait_v,
            __m256 loose_v)
{
    const __m256 v = _mm256_loadu_ps(x);
    const __m256 lhs = _mm256_mul_ps(_mm256_mul_ps(v, v), wait_v);
    const __m256 rhs = _mm256_mul_ps(loose_v, lane_ages(last, now_v));
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(lhs, rhs, _CMP_GE_OQ));
}

/* The exact score of 8 lanes (the same IEEE division, square root and product as
 * drift_keep), kept where score >= t, in ascending order. */
__attribute__((target("avx2,bmi"))) static inline void
drift_exact8(const float *x, const uint16_t *last, __m256i now_v, __m256 wait_v, __m256 t_v,
             int64_t at, int32_t *out, float *vals, int64_t cap, int64_t *count)
{
    const __m256 v = _mm256_loadu_ps(x);
    const __m256 w = _mm256_sqrt_ps(_mm256_div_ps(wait_v, lane_ages(last, now_v)));
    const __m256 abs_v = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(abs_v, w), t_v,
                                                            _CMP_GE_OQ));
    float signed_score[8];
    _mm256_storeu_ps(signed_score, _mm256_mul_ps(v, w));
    while (m) {
        const int j = __builtin_ctz(m);
        if (*count < cap) {
            out[*count] = (int32_t)(at + j);
            if (vals)
                vals[*count] = signed_score[j];
        }
        ++*count;
        m &= m - 1;
    }
}

__attribute__((target("avx2,bmi"))) static int64_t
drift_avx2(const float *x, const uint16_t *last, uint32_t now16, float wait, int64_t n,
           float t, int64_t base, int32_t *out, float *vals, int64_t cap)
{
    const float loose = t * t * (1.0f - 1e-6f);
    const __m256i now_v = _mm256_set1_epi32((int)now16);
    const __m256 wait_v = _mm256_set1_ps(wait), loose_v = _mm256_set1_ps(loose);
    const __m256 t_v = _mm256_set1_ps(t);
    int64_t count = 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        HVM_PREFETCH(x + i + PREFETCH_AHEAD);
        HVM_PREFETCH(x + i + PREFETCH_AHEAD + 16);
        HVM_PREFETCH(last + i + PREFETCH_AHEAD);
        const unsigned m0 = drift_lanes(x + i, last + i, now_v, wait_v, loose_v);
        const unsigned m1 = drift_lanes(x + i + 8, last + i + 8, now_v, wait_v, loose_v);
        const unsigned m2 = drift_lanes(x + i + 16, last + i + 16, now_v, wait_v, loose_v);
        const unsigned m3 = drift_lanes(x + i + 24, last + i + 24, now_v, wait_v, loose_v);
        if (!(m0 | m1 | m2 | m3))
            continue;
        if (m0)
            drift_exact8(x + i, last + i, now_v, wait_v, t_v, base + i, out, vals, cap,
                         &count);
        if (m1)
            drift_exact8(x + i + 8, last + i + 8, now_v, wait_v, t_v, base + i + 8, out,
                         vals, cap, &count);
        if (m2)
            drift_exact8(x + i + 16, last + i + 16, now_v, wait_v, t_v, base + i + 16, out,
                         vals, cap, &count);
        if (m3)
            drift_exact8(x + i + 24, last + i + 24, now_v, wait_v, t_v, base + i + 24, out,
                         vals, cap, &count);
    }
    return drift_portable(x + i, last + i, now16, wait, n - i, t, base + i, out, vals, cap,
                          count);
}
#endif

int64_t hvm_select_drift16_values(const float *x, const uint16_t *last, int64_t now,
                                  float wait, int64_t n, float t, int64_t base, int32_t *out,
                                  float *vals, int64_t cap)
{
    const uint32_t now16 = (uint32_t)(now & 0xffff);
#ifdef HVM_HAVE_AVX2_PATH
    if (have_avx2())
        return drift_avx2(x, last, now16, wait, n, t, base, out, vals, cap);
#endif
    return drift_portable(x, last, now16, wait, n, t, base, out, vals, cap, 0);
}

static struct PyModuleDef hvm_select_module = {PyModuleDef_HEAD_INIT, "_select",
                                               "Native threshold selection (see select.c).",
                                               -1, NULL};

PyMODINIT_FUNC PyInit__select(void) { return PyModule_Create(&hvm_select_module); }
