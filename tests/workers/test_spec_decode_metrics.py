"""Speculative decoding's drafted / accepted counts, acceptance rate and mean accepted length reach /metrics per
SLA class and method, from a real engine's stats."""
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tidepool.workers.engine import LLMEngine, SamplingParams
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.metrics import EngineMetrics


def _value(registry, name, **labels) -> float:
    return sum(s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples if s.name == name and set(labels.items()) <= set(s.labels.items()))


def test_spec_decode_counts_reach_metrics_per_class_and_method(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, speculative={"method": "ngram", "num_tokens": 3,
                                                                   "adaptive": False}))
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, worker="w")
    phrase = [21, 22, 23, 24, 25]
    engine.add_request("rt", phrase * 6, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                       sla_class="realtime")
    engine.add_request("off", phrase * 6, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                         speculate=False), sla_class="batch")
    while engine.has_unfinished():
        engine.step()
        metrics.update_from_stats(engine.stats())
    tally = engine.stats()["spec_decode"]["ngram"]
    rt = tally["realtime"]
    assert rt["drafted"] > 0 and tally["batch"]["drafted"] == 0          # the batch request opted out
    labels = dict(worker="w", sla_class="realtime", method="ngram")
    assert _value(registry, "tidepool:spec_decode_num_draft_tokens_total", **labels) == rt["drafted"]
    assert _value(registry, "tidepool:spec_decode_num_accepted_tokens_total", **labels) == rt["accepted"]
    assert _value(registry, "tidepool:spec_decode_num_verify_steps_total", **labels) == rt["verify_steps"]
    assert _value(registry, "tidepool:spec_decode_acceptance_rate", **labels) == rt["accepted"] / rt["drafted"]
    assert _value(registry, "tidepool:spec_decode_mean_accepted_length", **labels) == \
        1 + rt["accepted"] / rt["verify_steps"]
