"""The native parts of kvgraftd (daemon/kvgraftd/native): decode-step attention, and
SHA-256 of 16 pages at once.

Everything else about the package is in pyproject.toml. Each extension is a
plain shared library that kvgraftd loads with ctypes (kvgraftd.decode_attention,
kvgraftd.sha256_lanes); both are optional: where they cannot be built (no C
compiler), the daemon attends with torch alone and says so in its compute
profile, and hashes pages with hashlib.
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
        ),
        Extension(
            "kvgraftd._sha256_lanes",
            sources=[f"{NATIVE}/sha256_lanes.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
