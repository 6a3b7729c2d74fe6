"""The Hypothesis settings of the fuzz suites (tests/server/test_fuzz.py over gRPC,
tests/http/test_openai_fuzz.py over HTTP): bounded, derandomized (the same cases every
run, so a failure reproduces), no example database, no deadline (each case is a real call
to a real daemon), and the health checks that a module-wide daemon fixture trips off."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
