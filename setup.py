"""Only the native kernels live here (selection, and the fused accumulate + norm); all
metadata is in setup.cfg."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "horovod_micro._select",
            sources=["horovod_micro/_native/select.c",
                     "horovod_micro/_native/accumulate.c"],
            extra_compile_args=["-O3", "-fno-math-errno"],
        )
    ]
)
