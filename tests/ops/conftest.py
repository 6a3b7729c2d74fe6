"""The ops tests' fixtures: a test PKI for the metrics endpoint's TLS."""

from __future__ import annotations

import pytest

from tests.support.certs import Pki, make_pki, openssl_available


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is not installed (.ci/run installs it)")
    return make_pki(tmp_path_factory.mktemp("pki"))
