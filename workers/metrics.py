"""Worker-side metrics: Prometheus series under `tidepool:` (modelled on vLLM's) and the stats snapshot
the admin dashboard reads. Imports neither torch nor the engine.

A worker process does, around its engine loop:

    metrics = EngineMetrics(worker="gpu0", store=SnapshotStore(redis_client))   # redis_client None: in-process
    start_metrics_server(9101, metrics.registry)                                # its own /metrics
    ...
    outputs = engine.step()
    metrics.update_from_stats(engine.stats())            # every step (cheap) or at least every second
    for out in outputs:
        if out.finished:
            metrics.observe_request(out, sla_class, tenant, queue_time=started - queued)

The snapshot contract (SNAPSHOT_KEY, SNAPSHOT_TTL, SnapshotStore) lives in service/ledger/snapshots.py, which the
API and panel read without importing the workers; snapshot() lists the keys.
"""
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tidepool.service.ledger.models import SLA_CLASSES
from tidepool.service.ledger.registry import KV_CACHE_DTYPES
from tidepool.service.ledger.snapshots import SNAPSHOT_KEY, SNAPSHOT_TTL, SnapshotStore  # noqa: F401 (the workers' import point)

PUBLISH_INTERVAL = 1.0
MAX_TENANT_LABELS = 100  # beyond this many distinct tenants, the rest share the label "other"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
QUEUE_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

_COUNTERS = {"preemptions": "num_preemptions", "prefix_cache_queries": "prefix_cache_queries",
             "prefix_cache_hits": "prefix_cache_hits", "recomputed_tokens": "recomputed_tokens",
             "total_step_cuts": "step_cuts"}
PREEMPTION_KINDS = ("suspend", "swap", "recompute")


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, worker: str = "worker",
                 store: SnapshotStore | None = None, device: str | None = None, model: str | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.worker, self.store, self.device, self.model = worker, store, device, model
        r = self.registry
        self.ttft = Histogram("tidepool:time_to_first_token_seconds", "Time to first token (engine arrival to "
                              "first token).", ["sla_class"], buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("tidepool:e2e_request_latency_seconds", "End-to-end request latency in the "
                             "engine (arrival to finish).", ["sla_class"], buckets=E2E_BUCKETS, registry=r)
        self.itl = Histogram("tidepool:inter_token_latency_seconds", "Mean gap between output tokens, one "
                             "observation per request.", ["sla_class"], buckets=ITL_BUCKETS, registry=r)
        self.queue = Histogram("tidepool:request_queue_time_seconds", "Time a job waited in the ledger and "
                               "broker before a worker started it.", ["sla_class"], buckets=QUEUE_BUCKETS,
                               registry=r)
        self.prompt_tokens = Counter("tidepool:prompt_tokens", "Prompt tokens processed.",
                                     ["sla_class", "tenant"], registry=r)
        self.generation_tokens = Counter("tidepool:generation_tokens", "Generation tokens produced.",
                                         ["sla_class", "tenant"], registry=r)
        self.embedded_inputs = Counter("tidepool:embedded_inputs", "Inputs embedded (/v1/embeddings).",
                                       ["sla_class", "tenant", "model"], registry=r)
        self.embedded_tokens = Counter("tidepool:embedded_tokens", "Tokens of the inputs embedded.",
                                       ["sla_class", "tenant", "model"], registry=r)
        self.success = Counter("tidepool:request_success", "Finished requests by finish reason.",
                               ["sla_class", "finish_reason"], registry=r)
        self.running = Gauge("tidepool:num_requests_running", "Sequences in the running batch.",
                             ["worker", "sla_class"], registry=r)
        self.waiting = Gauge("tidepool:num_requests_waiting", "Sequences waiting to be scheduled.",
                             ["worker", "sla_class"], registry=r)
        self.kv_usage = Gauge("tidepool:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                              ["worker"], registry=r)
        self.kv_dtype = Gauge("tidepool:kv_cache_dtype", "KV cache element type the engine runs with: 1 on its "
                              "dtype (auto: the model's; fp8_e4m3, fp8_e5m2, int8: quantized).", ["worker", "dtype"],
                              registry=r)
        self.kv_fallbacks = Counter("tidepool:kv_quant_fallbacks", "Engines started on the 16-bit KV cache because "
                                    "the model's calibration refused the quantized dtype asked for (more than 2% "
                                    "lost).", ["worker"], registry=r)
        self.counters = {key: Counter(f"tidepool:{name}", f"Engine {name.replace('_', ' ')}.", ["worker"],
                                      registry=r) for key, name in _COUNTERS.items()}
        self.preemptions_by_kind = Counter("tidepool:preemptions_by_kind", "Engine preemptions by kind: suspend "
                                           "(keeps its blocks), swap (blocks to the host pool), recompute.",
                                           ["worker", "kind"], registry=r)
        self.iteration_tokens = Histogram("tidepool:iteration_tokens", "Tokens per engine step.", ["worker"],
                                          buckets=ITERATION_BUCKETS, registry=r)
        self.lora_adapters = Gauge("tidepool:lora_adapters", "LoRA adapters by state: resident (in a device slot), "
                                   "loading (being read from disk), host (host copies).", ["worker", "state"],
                                   registry=r)
        self.lora_evictions = Counter("tidepool:lora_evictions", "LoRA adapters that lost their device slot.",
                                      ["worker"], registry=r)
        self.lora_load_seconds = Counter("tidepool:lora_load_seconds", "Seconds spent reading LoRA adapters from "
                                         "disk.", ["worker"], registry=r)
        self.lora_tokens = Counter("tidepool:lora_tokens", "Tokens computed per LoRA adapter.", ["worker", "adapter"],
                                   registry=r)
        labels = ["worker", "sla_class", "method"]
        self.spec_drafted = Counter("tidepool:spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
                                    labels, registry=r)
        self.spec_accepted = Counter("tidepool:spec_decode_num_accepted_tokens", "Speculative draft tokens the "
                                     "target accepted.", labels, registry=r)
        self.spec_steps = Counter("tidepool:spec_decode_num_verify_steps", "Sequence steps that verified drafts.",
                                  labels, registry=r)
        self.spec_rate = Gauge("tidepool:spec_decode_acceptance_rate", "Accepted / drafted tokens since start.",
                               labels, registry=r)
        self.spec_length = Gauge("tidepool:spec_decode_mean_accepted_length", "Tokens emitted per verify step "
                                 "(accepted drafts + the target's own) since start.", labels, registry=r)
        self._last: dict[tuple[str, str], float] = {}     # (worker, stat) → last cumulative value seen
        self._tenants: set[str] = set()
        self._rate: dict[str, tuple[float, int, int]] = {}  # worker → (ts, prompt, generation) at last publish
        self._published: dict[str, float] = {}
        self._lock = threading.Lock()

    def _tenant(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._tenants or len(self._tenants) < MAX_TENANT_LABELS:
                self._tenants.add(tenant)
                return tenant
        return "other"

    def observe_request(self, output, sla_class: str, tenant: str, queue_time: float | None = None) -> None:
        """Record one finished RequestOutput (arrival_time, first_token_time, finished_time, token ids)."""
        tenant = self._tenant(tenant)
        n_out = len(output.token_ids)      # the first choice's tokens: its inter-token gaps
        self.prompt_tokens.labels(sla_class, tenant).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(sla_class, tenant).inc(output.generated_tokens or n_out)   # every choice
        self.success.labels(sla_class, output.finish_reason or "unknown").inc()
        if getattr(output, "embeddings", None) is not None:
            model = str(self.model).rstrip("/").rsplit("/", 1)[-1] if self.model else "default"
            self.embedded_inputs.labels(sla_class, tenant, model).inc(len(output.embeddings))
            self.embedded_tokens.labels(sla_class, tenant, model).inc(len(output.prompt_token_ids))
        if output.first_token_time is not None:
            self.ttft.labels(sla_class).observe(max(0.0, output.first_token_time - output.arrival_time))
            if output.finished_time is not None and n_out > 1:
                self.itl.labels(sla_class).observe(max(0.0, output.finished_time - output.first_token_time)
                                                   / (n_out - 1))
        if output.finished_time is not None:
            self.e2e.labels(sla_class).observe(max(0.0, output.finished_time - output.arrival_time))
        if queue_time is not None:
            self.queue.labels(sla_class).observe(max(0.0, queue_time))

    def update_from_stats(self, stats: dict, worker: str | None = None, now: float | None = None) -> None:
        """Set gauges and advance counters from LLMEngine.stats(); publish a snapshot at most once a second."""
        worker = worker or self.worker
        by_class = stats.get("by_class", {})
        for cls in SLA_CLASSES:
            counts = by_class.get(cls, {})
            self.running.labels(worker, cls).set(counts.get("running", 0))
            self.waiting.labels(worker, cls).set(counts.get("waiting", 0))
        self.kv_usage.labels(worker).set(stats.get("kv_cache_usage", 0.0))
        if "kv_cache_dtype" in stats:
            for dtype in KV_CACHE_DTYPES:
                self.kv_dtype.labels(worker, dtype).set(float(stats["kv_cache_dtype"] == dtype))
            if self._advance(worker, "kv_quant_fallbacks", stats.get("kv_quant_fallbacks", 0)):
                self.kv_fallbacks.labels(worker).inc()
        for key, counter in self.counters.items():
            delta = self._advance(worker, key, stats.get(key, 0))
            if delta:
                counter.labels(worker).inc(delta)
        kinds = stats.get("preemptions_by_kind", {})
        for kind in PREEMPTION_KINDS:
            delta = self._advance(worker, f"preemptions_{kind}", kinds.get(kind, 0))
            if delta:
                self.preemptions_by_kind.labels(worker, kind).inc(delta)
        if "lora" in stats:
            self._update_lora(stats["lora"], worker)
        if self._advance(worker, "total_steps", stats.get("total_steps", 0)):
            self.iteration_tokens.labels(worker).observe(stats.get("last_step", {}).get("tokens", 0))
        for method, by_cls in stats.get("spec_decode", {}).items():
            for cls, t in by_cls.items():
                for key, counter in (("drafted", self.spec_drafted), ("accepted", self.spec_accepted),
                                     ("verify_steps", self.spec_steps)):
                    delta = self._advance(worker, f"spec_{method}_{cls}_{key}", t.get(key, 0))
                    if delta:
                        counter.labels(worker, cls, method).inc(delta)
                if t.get("verify_steps"):
                    self.spec_rate.labels(worker, cls, method).set(t.get("acceptance_rate", 0.0))
                    self.spec_length.labels(worker, cls, method).set(t.get("mean_accepted_length", 0.0))
        now = time.time() if now is None else now
        if self.store is not None and now - self._published.get(worker, 0.0) >= PUBLISH_INTERVAL:
            self.store.put(self.snapshot(stats, worker, now))
            self._published[worker] = now

    def _update_lora(self, lora: dict, worker: str) -> None:
        for state, key in (("resident", "resident"), ("loading", "loading"), ("host", "host_copies")):
            self.lora_adapters.labels(worker, state).set(lora.get(key, 0))
        for key, counter in (("evicted", self.lora_evictions), ("load_s", self.lora_load_seconds)):
            delta = self._advance(worker, f"lora_{key}", lora.get(key, 0))
            if delta:
                counter.labels(worker).inc(delta)
        for adapter, tokens in lora.get("tokens", {}).items():
            delta = self._advance(worker, f"lora_tokens:{adapter}", tokens)
            if delta:
                self.lora_tokens.labels(worker, adapter).inc(delta)

    def _advance(self, worker: str, key: str, value: float) -> float:
        """Delta of a cumulative engine counter since the last call; an engine restart starts from zero."""
        last = self._last.get((worker, key), 0)
        self._last[(worker, key)] = value
        return value - last if value >= last else value

    def snapshot(self, stats: dict, worker: str | None = None, now: float | None = None) -> dict:
        """The JSON a worker publishes for the dashboard; token rates are since the previous snapshot."""
        worker = worker or self.worker
        now = time.time() if now is None else now
        prompt, gen = stats.get("total_prompt_tokens", 0), stats.get("total_generation_tokens", 0)
        prompt_rate = gen_rate = 0.0
        last = self._rate.get(worker)
        if last is not None and now > last[0]:
            dt = now - last[0]
            prompt_rate = max(0, prompt - last[1]) / dt
            gen_rate = max(0, gen - last[2]) / dt
        self._rate[worker] = (now, prompt, gen)
        return {"worker": worker, "device": self.device, "model": self.model, "ts": now,
                "running": stats.get("running", 0), "waiting": stats.get("waiting", 0),
                "by_class": stats.get("by_class", {}), "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
                "kv_blocks_used": stats.get("kv_blocks_used", 0), "kv_blocks_total": stats.get("kv_blocks_total", 0),
                "preemptions": stats.get("preemptions", 0),
                "preemptions_by_kind": stats.get("preemptions_by_kind", {}),
                "recomputed_tokens": stats.get("recomputed_tokens", 0),
                "prefix_cache_queries": stats.get("prefix_cache_queries", 0),
                "prefix_cache_hits": stats.get("prefix_cache_hits", 0),
                "total_prompt_tokens": prompt, "total_generation_tokens": gen,
                "prompt_tokens_per_s": prompt_rate, "generation_tokens_per_s": gen_rate,
                "total_steps": stats.get("total_steps", 0)}


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0"):
    """Serve `registry` on http://addr:port/metrics from a daemon thread; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=registry)


DEFAULT_PORTS = {"gpu": 9101, "cpu": 9102}     # per worker kind; a taken port moves on to the next free one


def bind_metrics_server(port: int, registry: CollectorRegistry, tries: int = 32, addr: str = "0.0.0.0") -> int:
    """Serve `registry` on the first free port from `port` on (at most `tries` ports); returns the bound port."""
    error = None
    for candidate in range(port, port + tries):
        try:
            start_metrics_server(candidate, registry, addr)
            return candidate
        except OSError as exc:
            error = exc
    raise OSError(f"no free port in {port}..{port + tries - 1}: {error}")

