/*
 * Threshold selection in one read pass (MiCRO's "no sort, no top-k" selection).
 *
 * hvm_select_abs_ge writes base + i for every i in [0, n) with |x[i]| >= t into out
 * (at most cap entries, in ascending order) and returns how many there are in all, so a
 * caller whose buffer was too small learns the size it needs. NaN never compares >= t.
 *
 * Why native: torch needs three passes with temporaries (abs, compare, nonzero) and runs
 * 10-30x slower than reading the floats once. Here each block of BLOCK floats is first
 * OR-reduced ("is anything above t?"), a loop GCC vectorises; only blocks with a hit are
 * scanned again, from L1. At densities <= 1 % most blocks have no hit, so the cost stays
 * close to one read of the data. target_clones picks an AVX2 body at load time where the
 * processor has it, and baseline x86-64 (SSE2) elsewhere.
 *
 * Loaded with ctypes (horovod_micro/selection.py); the Python module stub below only lets
 * setuptools build and install it like any extension.
 */
#include <Python.h>
#include <math.h>
#include <stdint.h>

#define BLOCK 64

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HVM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HVM_CLONES
#endif

HVM_CLONES
int64_t hvm_select_abs_ge(const float *x, int64_t n, float t, int64_t base, int32_t *out,
                          int64_t cap)
{
    int64_t count = 0;
    int64_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        int hit = 0;
        for (int j = 0; j < BLOCK; ++j)
            hit |= fabsf(x[i + j]) >= t;
        if (!hit)
            continue;
        for (int j = 0; j < BLOCK; ++j) {
            if (fabsf(x[i + j]) >= t) {
                if (count < cap)
                    out[count] = (int32_t)(base + i + j);
                ++count;
            }
        }
    }
    for (; i < n; ++i) {
        if (fabsf(x[i]) >= t) {
            if (count < cap)
                out[count] = (int32_t)(base + i);
            ++count;
        }
    }
    return count;
}

static struct PyModuleDef hvm_select_module = {PyModuleDef_HEAD_INIT, "_select",
                                               "Native threshold selection (see select.c).",
                                               -1, NULL};

PyMODINIT_FUNC PyInit__select(void) { return PyModule_Create(&hvm_select_module); }
