"""Tests of the native kernels where they may be missing: skipped on a developer's machine
without a C compiler, failed where the kernels are required.

KVGRAFT_REQUIRE_NATIVE=1 (exported by .ci/run and `make test`) says the native libraries
must be built and run here: the exactness tests are the product's central claim, so CI
must not pass by skipping them. `make test KVGRAFT_REQUIRE_NATIVE=0` (or pytest run
directly) keeps a machine without a compiler able to run the rest.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRED = os.environ.get("KVGRAFT_REQUIRE_NATIVE") == "1"


def missing(reason: str) -> NoReturn:
    """Skip (a test, or the whole module at import) for `reason`; fail instead where the
    native kernels are required."""
    if REQUIRED:
        pytest.fail(
            f"{reason}, and KVGRAFT_REQUIRE_NATIVE=1 requires the native kernels: build them "
            "(`make install` with a C compiler and libxxhash-dev)",
            pytrace=False,
        )
    pytest.skip(reason, allow_module_level=True)
