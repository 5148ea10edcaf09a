"""``a_t = e_t + g_t`` and ``||a_t||^2`` in one pass (error feedback's accumulate, fused
with the step's norm).

The reducer needs both: ``a_t`` to select from, and its squared norm for the NaN/Inf check
and the RMS scale of the density controllers. Two torch calls read N twice; the native
kernel ``_native/accumulate.c`` squares each entry while it is in a register, so the
norm costs no pass of its own (a second read of N saved every step). It serves contiguous
float32 CPU tensors, unless
``HOROVOD_MICRO_SELECT=torch`` forces the device-generic path; elsewhere (a GPU, float64)
:func:`add_and_square` says so and the reducer takes torch's two passes.
"""

from __future__ import annotations

import ctypes

import torch

from .native import forced_torch, native_library


def _load():
    lib = native_library()
    if lib is None:
        return None
    fn = lib.hvm_add_sumsq
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return fn


_native_add_sumsq = _load()


def _native_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()


def fused_available(buffer: torch.Tensor) -> bool:
    """Whether :func:`add_and_square` can serve slices of this flat buffer."""
    return _native_add_sumsq is not None and not forced_torch() and _native_ok(buffer)


def add_and_square(residual: torch.Tensor, grad: torch.Tensor | None,
                   out: torch.Tensor) -> float | None:
    """``out = residual + grad`` (``out = residual`` when ``grad`` is None), and the sum of
    ``out``'s squares in float64; None, with nothing written, where the native kernel
    cannot serve these tensors (the caller then adds and squares with torch)."""
    if not (fused_available(out) and _native_ok(residual)
            and (grad is None or _native_ok(grad))) or residual.numel() != out.numel():
        return None
    if grad is not None and grad.numel() != out.numel():
        return None
    return _native_add_sumsq(residual.data_ptr(),
                             None if grad is None else grad.data_ptr(),
                             out.data_ptr(), out.numel())
