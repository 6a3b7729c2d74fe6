"""The native part of kvgraftd: decode-step attention (daemon/kvgraftd/native).

Everything else about the package is in pyproject.toml. The extension is a
plain shared library that kvgraftd.decode_attention loads with ctypes; it is
optional: where it cannot be built (no C compiler), the daemon attends with
torch alone and says so in its compute profile.
"""

from setuptools import Extension, setup

NATIVE = "daemon/kvgraftd/native"

setup(
    ext_modules=[
        Extension(
            "kvgraftd._attend",
            sources=[f"{NATIVE}/attend.c", f"{NATIVE}/attend_avx512.c"],
            depends=[f"{NATIVE}/attend_kernel.h", f"{NATIVE}/xxhash.h"],
            include_dirs=[NATIVE],
            extra_compile_args=["-O3", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        )
    ]
)
