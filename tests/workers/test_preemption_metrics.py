"""Engine preemptions by kind and recomputed tokens reach /metrics and the dashboard snapshot."""
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tidepool.workers.metrics import EngineMetrics


def _value(registry, name, **labels) -> float:
    return sum(s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples if s.name == name and set(labels.items()) <= set(s.labels.items()))


def test_preemption_kinds_and_recomputed_tokens_are_counted():
    registry = CollectorRegistry()
    m = EngineMetrics(registry, worker="w")
    m.update_from_stats({"preemptions": 3, "preemptions_by_kind": {"suspend": 2, "swap": 0, "recompute": 1},
                         "recomputed_tokens": 40})
    m.update_from_stats({"preemptions": 6, "preemptions_by_kind": {"suspend": 4, "swap": 1, "recompute": 1},
                         "recomputed_tokens": 40})
    assert _value(registry, "tidepool:preemptions_by_kind_total", kind="suspend") == 4
    assert _value(registry, "tidepool:preemptions_by_kind_total", kind="swap") == 1
    assert _value(registry, "tidepool:preemptions_by_kind_total", kind="recompute") == 1
    assert _value(registry, "tidepool:recomputed_tokens_total") == 40
    assert _value(registry, "tidepool:num_preemptions_total") == 6
    snap = m.snapshot({"preemptions_by_kind": {"suspend": 4}, "recomputed_tokens": 40})
    assert snap["preemptions_by_kind"] == {"suspend": 4} and snap["recomputed_tokens"] == 40


def test_step_cuts_are_counted():
    registry = CollectorRegistry()
    m = EngineMetrics(registry, worker="w")
    m.update_from_stats({"total_step_cuts": 2})
    m.update_from_stats({"total_step_cuts": 5})
    assert _value(registry, "tidepool:step_cuts_total") == 5
