"""A daemon's Prometheus figures, as a test reads them (its --metrics-listen endpoint)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvgraftd.testing.daemon_process import DaemonProcess


def unlabelled_metrics(daemon: DaemonProcess) -> dict[str, float]:
    """Every sample without labels, by name."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }
