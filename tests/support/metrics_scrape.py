"""A daemon's Prometheus figures, as a test reads them (its --metrics-listen endpoint)."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from kvgraftd.testing.daemon_process import DaemonProcess


def _families(daemon: DaemonProcess):
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        return list(text_string_to_metric_families(response.read().decode()))


def unlabelled_metrics(daemon: DaemonProcess) -> dict[str, float]:
    """Every sample without labels, by name."""
    return {
        sample.name: sample.value
        for family in _families(daemon)
        for sample in family.samples
        if not sample.labels
    }


def labelled_metrics(daemon: DaemonProcess) -> dict[tuple[str, tuple], float]:
    """Every sample, by (name, its labels as sorted (key, value) pairs)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in _families(daemon)
        for sample in family.samples
    }


def probe_registry() -> CollectorRegistry:
    """A registry of one figure, `probe_scrapes_total 1.0`, to find in a scrape."""
    registry = CollectorRegistry()
    Counter("probe_scrapes", "a figure to find in a scrape", registry=registry).inc()
    return registry
