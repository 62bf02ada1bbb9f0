"""Workers for registered models (service/ledger/registry.py): `tidepool worker [--models a,b]` and `tidepool serve`.

Without --models a worker serves every enabled registered model whose weights fit its memory budget
(fitting_models), or, when no other model is registered, the deployment's default model alone as ever.
Each model gets its own Worker (its own engine, on a thread of this process) consuming that model's queues
(service/ledger/dispatch.py queue_name: the bare class queues for the deployment's default model, `<class>@<model>`
for any other); their engines share the device through one DeviceStepper, the most urgent SLA class first
(workers/device_stepper.py). Hot models are loaded at start and kept; warm ones load when their queues hold work
and cold ones after `tidepool models warm NAME`, unloaded least recently busy first to fit --memory-budget-mb
(ModelHost). The budget holds the loaded models' weights and KV pools together: each engine's pool is sized when
its model loads, from what the budget has left, split by demand (ModelHost.pool_blocks)."""
import dataclasses
import json
import logging
import signal
import threading
import time

from tidepool.service.ledger import cluster_queues, redis_conn
from tidepool.service.ledger.registry import WARM_KEY   # set by `tidepool models warm NAME`

log = logging.getLogger(__name__)


MB = 1 << 20


def registry_entries(settings) -> dict:
    """Every registered model by name (service/ledger/registry.py Registry.entries), read once."""
    from tidepool.service.ledger.database import make_engine
    from tidepool.service.ledger.registry import Registry

    db = make_engine(settings.database_url)
    try:
        return Registry(db, settings.served_model_name, settings.model).entries()
    finally:
        db.dispose()


def device_memory(device: str) -> int:
    """What the device can hold: a GPU's total memory; on the CPU, the memory available now."""
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    from tidepool.workers.engine.model_runner import available_memory
    return available_memory()


def memory_budget(args, device: str) -> int:
    """Bytes of weights and KV pools a worker process may hold loaded: --memory-budget-mb, else the device's
    memory."""
    mb = getattr(args, "memory_budget_mb", None)
    return int(mb * MB) if mb is not None else device_memory(device)


def fitting_models(entries: dict, default_name: str | None, budget: int, skip_cold: bool = False,
                   device: str = "cpu", engine_overrides: dict | None = None) -> list[str]:
    """The models a worker serves without --models: every enabled registered model whose weights and smallest KV
    pool (min_footprint) fit the budget beside the hot models' (hot ones are kept loaded, so they count together;
    a warm or cold one needs only room beside them, ModelHost unloads the others) and whose largest rank fits one
    device at its tensor_parallel_size, the default model first, then hot ones, by name. engine_overrides: the
    EngineConfig fields the models' engines get (each model's own laid over them). Each enabled model left out is
    logged once here with the reason; disabled ones are left out silently."""
    from pathlib import Path

    from tidepool.workers.config_fields import model_engine_fields
    from tidepool.workers.engine.model_runner import DoesNotFit
    order = sorted((e for e in entries.values() if e.enabled and not (skip_cold and e.tier == "cold")),
                   key=lambda e: (e.name != default_name, e.tier != "hot", e.name))
    hot, out = 0, []
    for e in order:
        if not e.source or not (Path(e.source) / "config.json").is_file():
            reason = f"no model folder at {e.source}"
        else:
            try:
                need = min_footprint(e.source, device, {**(engine_overrides or {}), **model_engine_fields(e)})
                beside = f" beside the hot models' {hot / MB:.1f} MB" if hot else ""
                reason = (f"its weights and smallest KV pool ({need / MB:.1f} MB) do not fit the memory budget "
                          f"({budget / MB:.1f} MB){beside}" if hot + need > budget else None)
            except DoesNotFit as exc:
                reason = str(exc)
            except (ValueError, KeyError, OSError) as exc:
                reason = f"its engine config does not load ({exc})"
        if reason:
            log.warning("model %s is not served: %s", e.name, reason,
                        extra={"event": "model.skipped", "model": e.name})
            continue
        hot += need if e.tier == "hot" else 0
        out.append(e.name)
    return out


def model_configs(names: list[str], settings, kind: str, device: str, engine_overrides: dict | None = None,
                  base_name: str | None = None, entries: dict | None = None) -> list:
    """One WorkerConfig per registered model name, its engine fields the settings', the flags' (engine_overrides)
    and, over them, the model's own (model_engine_fields); a name the registry does not know, or has disabled,
    fails here (SystemExit with the reason)."""
    from tidepool.workers.config_fields import model_engine_fields
    from tidepool.workers.worker import WorkerConfig

    entries = registry_entries(settings) if entries is None else entries
    out = []
    for name in names:
        entry = entries.get(name)
        if entry is None or not entry.source:
            raise SystemExit(f"model {name!r} is not registered (tidepool models register {name} DIR); "
                             f"registered: {', '.join(sorted(entries)) or 'none'}")
        if not entry.enabled:
            raise SystemExit(f"model {name!r} is disabled in the registry")
        cfg = WorkerConfig.from_env(kind=kind, device=device, model=entry.source,
                                    serves=None if name == settings.served_model_name else name)
        base = base_name or cfg.name
        cfg.name = base if len(names) == 1 else f"{base}.{name}"
        cfg.engine.update({**(engine_overrides or {}), **model_engine_fields(entry)})
        out.append(cfg)
    return out


def main(args) -> int:
    """`tidepool worker [--models a,b] [--memory-budget-mb N]`: serve the listed registered models (default:
    every enabled one whose weights fit the budget, fitting_models) until SIGTERM, hot ones loaded from the start,
    warm and cold ones as ModelHost decides. When nothing but the deployment's default model is to be served, this
    is the plain one-model worker (workers/worker.py main): same name, queues and metrics ports as ever."""
    from tidepool.service.ledger.settings import Config
    from tidepool.workers import worker as one_model
    from tidepool.workers.config_fields import engine_fields, model_engine_fields, refuse_unstartable
    from tidepool.workers.metrics import DEFAULT_PORTS, bind_metrics_server

    def alone() -> int:      # the deployment's default model alone, with what its registry row carries
        args.engine = {**(getattr(args, "engine", None) or {}),
                       **model_engine_fields(entries.get(settings.served_model_name))}
        return one_model.main(args)

    settings = Config.from_env()
    device = args.device or one_model.default_device()
    if args.models is not None:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        if not names:
            raise SystemExit("--models needs at least one registered model name")
        entries = registry_entries(settings)
        budget = memory_budget(args, device)
    else:
        try:
            entries = registry_entries(settings)
        except Exception as exc:   # a ledger without the models table yet: the deployment's model, as before
            log.warning("model registry unreadable (%s): serving %s alone", exc, settings.model)
            return one_model.main(args)
        others = [e for e in entries.values() if e.enabled and e.name != settings.served_model_name]
        if not others:
            return alone()
        budget = memory_budget(args, device)
        fields = {**engine_fields(settings, device), **(getattr(args, "engine", None) or {})}
        names = fitting_models(entries, settings.served_model_name, budget, device=device, engine_overrides=fields)
        if set(names) <= {settings.served_model_name}:
            return alone()
    # several models share one device: `auto` is the gpu kind there (a cpu fallback is a `--kind cpu` worker)
    kind = "gpu" if args.kind == "auto" else args.kind
    cfgs = model_configs(names, settings, kind, device, getattr(args, "engine", None), settings.worker_name,
                         entries)
    for cfg in cfgs:
        refuse_unstartable(cfg.model, cfg.device, cfg.engine, "worker")
    client = redis_conn.client(settings.redis_url) if settings.redis_url else None
    host = ModelHost([(n, entries[n].tier, c) for n, c in zip(names, cfgs)], client, budget)
    port = DEFAULT_PORTS[kind] if settings.metrics_port is None else settings.metrics_port
    if port:
        try:   # this process's model series; each hot model's engine series on the next free ports
            host.metrics_port = bind_metrics_server(port, host.registry)
            port = host.metrics_port + 1
        except OSError as exc:
            log.warning("no /metrics: %s", exc)
            port = None
    stop = threading.Event()

    def _stop(*_):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    base = cfgs[0].name if len(names) == 1 else cfgs[0].name[:-len(names[0]) - 1]    # "<base>.<model>"
    host_name = f"{base}/models"
    host.advertise(host_name)
    host.tick()                      # the hot models, and whatever already waits for a warm one
    for name, (worker, _) in host.loaded.items():
        worker.metrics_port = None
        if port and host.models[name]["tier"] == "hot":
            try:
                worker.metrics_port = port = bind_metrics_server(port, worker.metrics.registry)
                port += 1
            except OSError as exc:
                log.warning("worker %s: no /metrics: %s", worker.cfg.name, exc)
    print(json.dumps({"models": names, "memory_budget_mb": round(budget / MB, 1), "metrics_port": host.metrics_port}),
          flush=True)
    for name, cfg in zip(names, cfgs):
        print(json.dumps({"worker": cfg.name, "kind": cfg.kind, "device": cfg.device, "model": name,
                          "tier": host.models[name]["tier"], "loaded": name in host.loaded, "source": cfg.model,
                          "queues": list(cfg.queues)}), flush=True)
    while not stop.is_set() and all(t.is_alive() for _, t in host.loaded.values()):
        stop.wait(0.5)
        if not stop.is_set():
            host.tick()
            host.advertise(host_name)
    host.stop()
    if client is not None:
        from tidepool.service.ledger.registry import HOSTS_KEY
        client.hdel(HOSTS_KEY, host_name)
    return 0


def register_first_start(engine, settings, actor: str = "serve") -> list[str]:
    """`tidepool serve` on an empty registry: register the default model (hot) and every other model folder in
    TIDEPOOL_MODELS_DIR (warm, named after its folder); returns the names registered (none after the first
    start: the registry is the operator's from then on)."""
    from pathlib import Path

    from tidepool.service.ledger import registry
    from tidepool.service.ledger.database import session
    with session(engine) as s:
        if not registry.is_empty(s):
            return []
        names = []
        if settings.served_model_name and settings.model:
            registry.register(s, settings.served_model_name, str(Path(settings.model).resolve()), "hot", actor=actor)
            names.append(settings.served_model_name)
        root = Path(settings.models_dir)
        for folder in sorted(root.iterdir()) if root.is_dir() else []:
            if (folder / "config.json").is_file() and registry.NAME.fullmatch(folder.name) \
                    and folder.name not in names and folder.resolve() != Path(settings.model or "").resolve():
                registry.register(s, folder.name, str(folder.resolve()), "warm", actor=actor)
                names.append(folder.name)
        s.commit()
    return names


def other_model_configs(engine, settings, device: str, engine_overrides: dict | None = None,
                        base_name: str = "embedded-gpu") -> list:
    """Worker configs for `tidepool serve`: every enabled hot or warm registered model besides the default one
    (which the embedded gpu worker serves) whose weights fit the device's memory, as a worker's default
    (fitting_models; every one of them is loaded, so all count together), named `<base_name>.<model>`; cold
    models wait for an operator."""
    from tidepool.service.ledger.registry import Registry
    from tidepool.workers.config_fields import engine_fields
    entries = Registry(engine, settings.served_model_name, settings.model).entries()
    if not any(e.enabled and e.tier != "cold" and e.name != settings.served_model_name for e in entries.values()):
        return []
    loaded = {n: dataclasses.replace(e, tier="hot") for n, e in entries.items() if e.tier != "cold"}
    fields = {**engine_fields(settings, device), **(engine_overrides or {})}
    names = [n for n in fitting_models(loaded, settings.served_model_name, device_memory(device), device=device,
                                       engine_overrides=fields) if n != settings.served_model_name]
    cfgs = model_configs(names, settings, "gpu", device, engine_overrides, base_name, entries) if names else []
    if len(names) == 1:
        cfgs[0].name = f"{base_name}.{names[0]}"
    return cfgs


# ---- hot / warm / cold ---------------------------------------------------------------------------------------



def folder_bytes(folder: str) -> int:
    """What a model's weights take: the size of its *.safetensors files (the KV pool is not counted)."""
    from pathlib import Path
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def ranks_held(ecfg) -> int:
    """How many of a model's tensor-parallel ranks the memory budget holds: rank 0 alone on a GPU (the budget is
    one device's, and every rank has a device of its own), every rank on the CPU (they share the host's memory)."""
    return 1 if ecfg.device.startswith("cuda") else ecfg.tensor_parallel_size


def weight_bytes(folder: str, ecfg) -> int:
    """What a model's weights take of the budget: its files' size (folder_bytes); at tensor_parallel_size N, one
    rank's share of it (the largest rank's, sharding.largest_rank_weight_bytes, of the whole model's; the norms, and
    KV heads fewer than the ranks, are held by each rank) times ranks_held."""
    from tidepool.workers.engine.models.sharding import largest_rank_weight_bytes
    size = ecfg.tensor_parallel_size
    if size == 1:
        return folder_bytes(folder)
    m = ecfg.model_config
    return folder_bytes(folder) * largest_rank_weight_bytes(m, size, 1) * ranks_held(ecfg) // \
        largest_rank_weight_bytes(m, 1, 1)


def block_bytes(ecfg) -> int:
    """What one KV block takes of the budget: a block on each rank held (EngineConfig.kv_block_bytes is a rank's)."""
    return ecfg.kv_block_bytes * ranks_held(ecfg)


def engine_config(folder: str, device: str, engine_overrides: dict | None = None):
    """The EngineConfig an engine of this model would run with (reads config.json only, loads no weights)."""
    from tidepool.workers.engine import EngineConfig
    return EngineConfig(model=folder, device=device, **(engine_overrides or {}))


def min_footprint(folder: str, device: str, engine_overrides: dict | None = None) -> int:
    """The least a loaded model takes of the budget: its weights and a KV pool for one sequence of its full context
    (or the num_kv_blocks an operator fixed). A model whose largest rank does not fit one device has none: it is
    refused (model_runner.DoesNotFit, naming the tensor_parallel_size that fits)."""
    from tidepool.workers.engine.model_runner import check_fits
    ecfg = engine_config(folder, device, engine_overrides)
    check_fits(ecfg)
    return weight_bytes(folder, ecfg) + (ecfg.num_kv_blocks or ecfg.blocks_per_sequence) * block_bytes(ecfg)


class ModelHost:
    """The models of one worker process (`tidepool worker --models a,b --memory-budget-mb N`). Hot models are
    loaded at start and kept. A warm model is loaded when one of its queues holds work, a cold one only after
    `tidepool models warm NAME`. The budget holds the loaded models' weights and KV pools: a model is loaded only
    when its weights and smallest pool fit (to make room the least recently busy warm or cold model with nothing
    in flight is unloaded first, never one that is running jobs; its queued work waits in the broker, so nothing
    is lost or run twice), and its engine gets the pool pool_blocks decides. Unloading returns both. Each load
    and unload is logged with its duration and exported as tidepool:model_loaded{model} and
    tidepool:model_load_seconds{model}. The loaded models' engines share the device through one DeviceStepper
    (workers/device_stepper.py)."""

    def __init__(self, models: list[tuple[str, str, object]], redis_client, budget_bytes: int | None,
                 make_worker=None, registry=None):
        from prometheus_client import CollectorRegistry, Gauge, Histogram
        self.models = {}
        for name, tier, cfg in models:
            ecfg = engine_config(cfg.model, cfg.device, cfg.engine)
            self.models[name] = {"tier": tier, "cfg": cfg, "bytes": weight_bytes(cfg.model, ecfg), "engine": ecfg,
                                 "block_bytes": block_bytes(ecfg),
                                 "min_blocks": ecfg.num_kv_blocks or ecfg.blocks_per_sequence}
        self.redis, self.budget = redis_client, budget_bytes
        self.make_worker = make_worker or self._make_worker
        self.loaded: dict[str, tuple] = {}           # name -> (worker, thread)
        self.pools: dict[str, int] = {}              # name -> KV blocks its engine was given (loaded models)
        self.busy_at: dict[str, float] = {}          # name -> when it last had work (LRU order)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.loaded_gauge = Gauge("tidepool:model_loaded", "1 while the model is loaded in this worker process.",
                                  ["model"], registry=self.registry)
        self.load_seconds = Histogram("tidepool:model_load_seconds", "Seconds to load a model (weights, KV pool).",
                                      ["model"], registry=self.registry,
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        for name in self.models:
            self.loaded_gauge.labels(name).set(0)
        self.events: list[tuple[str, str]] = []       # ("load" | "unload", model), in order
        self.metrics_port: int | None = None
        # The loaded models' engines share the device through one gate (workers/device_stepper.py): offline steps
        # overlap; online work of any model steps first, one step at a time, turns shared by step time; offline
        # work beside it keeps the engines' offline floor.
        from tidepool.workers.device_stepper import DeviceStepper
        floors = [m["engine"].offline_floor for m in self.models.values()]
        self.stepper = DeviceStepper(**({"offline_floor": min(floors)} if floors else {}))

    @staticmethod
    def _make_worker(cfg):
        from tidepool.workers.worker import Worker
        return Worker(cfg)

    def _depth(self, name: str) -> int:
        if self.redis is None:
            return 0
        return sum(cluster_queues.depth(self.redis, q) for q in self.models[name]["cfg"].queues)

    def _wanted(self, name: str) -> bool:
        tier = self.models[name]["tier"]
        if tier == "hot":
            return True
        if tier == "cold" and (self.redis is None or not self.redis.exists(WARM_KEY.format(name))):
            return False
        return self._depth(name) > 0

    def _idle(self, name: str) -> bool:
        worker, _ = self.loaded[name]
        return not worker.inflight and self._depth(name) == 0

    def used_bytes(self) -> int:
        """Bytes the loaded models hold: weights and KV pools."""
        return sum(self.models[n]["bytes"] + self.pools.get(n, 0) * self.models[n]["block_bytes"]
                   for n in self.loaded)

    def _least(self, name: str) -> int:
        """Bytes the model needs loaded at the least: weights and its floor pool."""
        m = self.models[name]
        return m["bytes"] + m["min_blocks"] * m["block_bytes"]

    def demand(self, name: str) -> int:
        """A model's weight in the KV split: 1 + its queued jobs + the jobs its engine is running (the 1 gives a
        model without work an even share beside other idle ones)."""
        running = len(self.loaded[name][0].inflight) if name in self.loaded else 0
        return 1 + self._depth(name) + running

    def pool_blocks(self, name: str, pending: list[str] = (), demand: dict | None = None) -> int | None:
        """The KV blocks `name`'s engine gets when it loads now. The pool share of the budget (the budget less the
        weights of the loaded models, this one and `pending`, the wanted ones that load after it in this pass) is
        split in proportion to demand(); this model gets its part, never more than the budget has left once the
        loaded models' weights and pools, its own weights and the pending models' weights and floor pools are
        counted, clamped between its floor (one sequence of its full context: what a loaded model needs to run at
        all) and its ceiling (the pool its engine would size for itself: model_runner.default_kv_blocks). A
        num_kv_blocks the operator set is used as is; without a budget the engine sizes its own pool (None)."""
        from tidepool.workers.engine.model_runner import default_kv_blocks
        m = self.models[name]
        if m["engine"].num_kv_blocks:
            return m["engine"].num_kv_blocks
        if self.budget is None:
            return None
        demand = demand if demand is not None else {}
        weight = {n: demand.get(n) or self.demand(n) for n in (*self.loaded, name, *pending)}
        pool_bytes = self.budget - sum(self.models[n]["bytes"] for n in weight)
        fair = pool_bytes * weight[name] // sum(weight.values())
        left = (self.budget - self.used_bytes() - m["bytes"]
                - sum(self._least(n) for n in pending if n not in self.loaded))
        floor = m["min_blocks"]
        share = weight[name] / sum(weight.values())       # of the host's KV budget, as of the pool share above
        ceiling = max(floor, default_kv_blocks(dataclasses.replace(m["engine"], kv_share=share))[0])
        return max(floor, min(ceiling, min(fair, left) // m["block_bytes"]))

    def load(self, name: str, kv_blocks: int | None = None) -> None:
        """Start `name`'s worker and engine, its KV pool `kv_blocks` blocks (None: the engine's own sizing)."""
        cfg = self.models[name]["cfg"]
        if kv_blocks is not None:
            cfg = dataclasses.replace(cfg, engine={**cfg.engine, "num_kv_blocks": kv_blocks})
        started = time.perf_counter()
        worker = self.make_worker(cfg)
        worker.stepper = self.stepper
        thread = threading.Thread(target=worker.run, name=cfg.name, daemon=True)
        thread.start()
        seconds = time.perf_counter() - started
        self.loaded[name] = (worker, thread)
        blocks = getattr(getattr(getattr(worker, "engine", None), "runner", None), "num_kv_blocks", kv_blocks)
        self.pools[name] = blocks or 0
        self.busy_at[name] = time.monotonic()
        self.loaded_gauge.labels(name).set(1)
        self.load_seconds.labels(name).observe(seconds)
        self.events.append(("load", name))
        pool_mb = (blocks or 0) * self.models[name]["block_bytes"] / MB
        log.info("model %s loaded in %.2f s (%s, KV pool %s blocks, %.1f MB)", name, seconds,
                 self.models[name]["tier"], blocks, pool_mb,
                 extra={"event": "model.loaded", "model": name, "seconds": round(seconds, 3), "kv_blocks": blocks})

    def unload(self, name: str) -> None:
        worker, thread = self.loaded.pop(name)
        self.pools.pop(name, None)
        started = time.perf_counter()
        worker.stop()
        thread.join(120)
        del worker
        import gc
        gc.collect()
        self.loaded_gauge.labels(name).set(0)
        self.events.append(("unload", name))
        log.info("model %s unloaded in %.2f s", name, time.perf_counter() - started,
                 extra={"event": "model.unloaded", "model": name})

    def advertise(self, name: str) -> None:
        """Tell the admin queues view which queues this process serves, its unloaded warm models' included (and a
        cold model's while it may be warmed)."""
        if self.redis is None:
            return
        from tidepool.service.ledger.registry import HOSTS_KEY
        queues = [q for n, m in self.models.items() if n in self.loaded or m["tier"] != "cold"
                  or self.redis.exists(WARM_KEY.format(n)) for q in m["cfg"].queues]
        try:
            self.redis.hset(HOSTS_KEY, name, json.dumps({"queues": queues, "at": time.time()}))
        except Exception as exc:   # the view shows "no worker" meanwhile; serving goes on
            log.warning("model host %s: advertising failed: %s", name, exc)

    def tick(self) -> None:
        """One pass: note which loaded models are busy, then load what is wanted (hot ones first), making room LRU,
        each with the pool pool_blocks gives it from the demand read at the start of the pass."""
        now = time.monotonic()
        for name, (worker, _) in self.loaded.items():
            if worker.inflight or self._depth(name):
                self.busy_at[name] = now
        wanted = [n for n in sorted(self.models, key=lambda n: self.models[n]["tier"] != "hot")
                  if n not in self.loaded and self._wanted(n)]
        demand = {n: self.demand(n) for n in (*self.loaded, *wanted)} if wanted and self.budget is not None else {}
        for i, name in enumerate(wanted):
            need = self._least(name)
            while self.budget is not None and self.used_bytes() + need > self.budget:
                victims = sorted((n for n in self.loaded if self.models[n]["tier"] != "hot" and self._idle(n)),
                                 key=lambda n: self.busy_at.get(n, 0))
                if not victims:
                    break
                self.unload(victims[0])
            if self.budget is None or self.used_bytes() + need <= self.budget:
                pending, room = [], self.budget - self.used_bytes() - need if self.budget is not None else 0
                for other in wanted[i + 1:]:          # those that still fit beside it, at their least
                    if self.budget is not None and self._least(other) <= room:
                        pending.append(other)
                        room -= self._least(other)
                self.load(name, self.pool_blocks(name, pending, demand))

    def stop(self) -> None:
        for name in list(self.loaded):
            worker, thread = self.loaded[name]
            worker.stop()
        for name in list(self.loaded):
            self.loaded[name][1].join(60)
