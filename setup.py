"""The native parts of kvgraftd: attention, the row-invariant linear product and the
forward's row-wise operations (daemon/kvgraftd/engine/native), SHA-256 of 16 pages
at once and guarded, checked copies out of segment mappings (daemon/kvgraftd/store/native).

Everything else about the package is in pyproject.toml. Each extension but one is a
plain shared library that kvgraftd loads with ctypes (kvgraftd.engine.model.decode_attention,
kvgraftd.engine.model.linear, kvgraftd.store.sha256_lanes); the store's guarded copies are a
Python module (kvgraftd.store._mapped_pages: it takes the readers' buffers through the buffer
protocol). All are optional: where they cannot be built (no C compiler), the daemon
computes with torch alone on its fixed schedule and says so in its compute profile, hashes
pages with hashlib and reads segments with pread.

The attention kernel takes xxHash from the system (`#include <xxhash.h>`, inlined:
Debian's libxxhash-dev, which `make install` and .ci/run install with the compiler).
Every kernel asks the CPU what it runs through one header, engine/native/cpu_features.h.
"""

from setuptools import Extension, setup

ENGINE_NATIVE = "daemon/kvgraftd/engine/native"  # one folder per kernel library
ATTEND, LINEAR = f"{ENGINE_NATIVE}/attend", f"{ENGINE_NATIVE}/linear"
STORE_NATIVE = "daemon/kvgraftd/store/native"
# what every engine library includes: the CPU's features, the exported constants' table
SHARED_HEADERS = [f"{ENGINE_NATIVE}/cpu_features.h", f"{ENGINE_NATIVE}/constants_table.h"]

setup(
    ext_modules=[
        Extension(
            "kvgraftd.engine.model._attend",
            sources=[
                f"{ATTEND}/attend.c",
                f"{ATTEND}/attend_avx2.c",
                f"{ATTEND}/attend_avx512.c",
                f"{ATTEND}/attend_limits.c",
            ],
            depends=[
                f"{ATTEND}/attend_kernel.h",
                f"{ATTEND}/attend_vectors.h",
                f"{ATTEND}/attend_limits.h",
                *SHARED_HEADERS,
            ],
            include_dirs=[ATTEND, ENGINE_NATIVE],
            # written sums and products, never fused: every build gives the portable one's bits
            extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "kvgraftd.engine.model._linear",
            sources=[
                f"{LINEAR}/linear.c",
                f"{LINEAR}/linear_avx2.c",
                f"{LINEAR}/linear_avx512.c",
                f"{LINEAR}/linear_quant.c",
                f"{LINEAR}/linear_int8.c",
                f"{LINEAR}/linear_int8_avx2.c",
                f"{LINEAR}/rowwise.c",
                f"{LINEAR}/layer.c",
                f"{LINEAR}/gguf_blocks.c",
            ],
            depends=[
                f"{LINEAR}/gguf_blocks.h",
                f"{LINEAR}/linear_kernel.h",
                f"{LINEAR}/linear_formats.h",
                f"{LINEAR}/linear_int8.h",
                *SHARED_HEADERS,
            ],
            include_dirs=[LINEAR, ENGINE_NATIVE],
            # every sum is an explicit FMA chain: nothing for the compiler to reorder or fuse
            extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "kvgraftd.store._sha256_lanes",
            sources=[f"{STORE_NATIVE}/sha256_lanes.c"],
            depends=[f"{ENGINE_NATIVE}/cpu_features.h"],
            include_dirs=[ENGINE_NATIVE],  # the one CPU-feature header
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvgraftd.store._mapped_pages",
            sources=[
                f"{STORE_NATIVE}/mapped_pages.c",
                f"{STORE_NATIVE}/mapped_copy_avx2.c",
                f"{STORE_NATIVE}/mapped_copy_avx512.c",
            ],
            depends=[f"{STORE_NATIVE}/mapped_copy.h", f"{ENGINE_NATIVE}/cpu_features.h"],
            include_dirs=[STORE_NATIVE, ENGINE_NATIVE],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
