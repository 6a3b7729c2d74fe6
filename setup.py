"""The native parts of kvgraftd: attention, the row-invariant linear product and the
forward's row-wise operations (daemon/kvgraftd/engine/native), and SHA-256 of 16 pages at once (daemon/kvgraftd/store/native).

Everything else about the package is in pyproject.toml. Each extension is a
plain shared library that kvgraftd loads with ctypes (kvgraftd.engine.decode_attention,
kvgraftd.engine.linear, kvgraftd.store.sha256_lanes); all are optional: where they
cannot be built (no C compiler), the daemon computes with torch alone on its fixed
schedule and says so in its compute profile, and hashes pages with hashlib.
"""

from setuptools import Extension, setup

ENGINE_NATIVE = "daemon/kvgraftd/engine/native"
STORE_NATIVE = "daemon/kvgraftd/store/native"

setup(
    ext_modules=[
        Extension(
            "kvgraftd.engine._attend",
            sources=[f"{ENGINE_NATIVE}/attend.c", f"{ENGINE_NATIVE}/attend_avx512.c"],
            depends=[f"{ENGINE_NATIVE}/attend_kernel.h", f"{ENGINE_NATIVE}/xxhash.h"],
            include_dirs=[ENGINE_NATIVE],
            extra_compile_args=["-O3", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "kvgraftd.engine._linear",
            sources=[
                f"{ENGINE_NATIVE}/linear.c",
                f"{ENGINE_NATIVE}/linear_avx2.c",
                f"{ENGINE_NATIVE}/linear_avx512.c",
                f"{ENGINE_NATIVE}/linear_quant.c",
                f"{ENGINE_NATIVE}/rowwise.c",
            ],
            depends=[f"{ENGINE_NATIVE}/linear_kernel.h", f"{ENGINE_NATIVE}/linear_formats.h"],
            include_dirs=[ENGINE_NATIVE],
            # every sum is an explicit FMA chain: nothing for the compiler to reorder or fuse
            extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "kvgraftd.store._sha256_lanes",
            sources=[f"{STORE_NATIVE}/sha256_lanes.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
