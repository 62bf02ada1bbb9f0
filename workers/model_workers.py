"""Workers for registered models (service/registry.py): `tidepool worker --models a,b` and `tidepool serve`.

Each model gets its own Worker (its own engine, on a thread of this process) consuming that model's queues
(service/dispatch.py queue_name: the bare class queues for the deployment's default model, `<class>@<model>`
for any other). Every listed model stays loaded (the hot tier); the warm/cold lifecycle (load on demand, LRU
unload under one memory budget) is not built yet, so list only models that fit together."""
import json
import logging
import signal
import threading
import time

log = logging.getLogger(__name__)


def model_configs(names: list[str], settings, kind: str, device: str, engine_overrides: dict | None = None,
                  base_name: str | None = None) -> list:
    """One WorkerConfig per registered model name; a name the registry does not know, or has disabled, fails
    here (SystemExit with the reason)."""
    from service.db import make_engine
    from service.registry import Registry
    from workers.worker import WorkerConfig

    db = make_engine(settings.database_url)
    try:
        entries = Registry(db, settings.served_model_name, settings.model).entries()
    finally:
        db.dispose()
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
        cfg.engine.update(engine_overrides or {})
        out.append(cfg)
    return out


def main(args) -> int:
    """`tidepool worker --models a,b`: load every listed model, then serve all of them until SIGTERM."""
    from service.config import Config
    from workers.metrics import DEFAULT_PORTS, bind_metrics_server
    from workers.worker import Worker, default_device

    settings = Config.from_env()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if not names:
        raise SystemExit("--models needs at least one registered model name")
    cfgs = model_configs(names, settings, args.kind, args.device or default_device(),
                         getattr(args, "engine", None), settings.worker_name)
    workers = []
    for name, cfg in zip(names, cfgs):
        started = time.perf_counter()
        log.info("worker %s: loading %s (%s) on %s", cfg.name, name, cfg.model, cfg.device,
                 extra={"worker": cfg.name, "event": "model.loading", "model": name})
        worker = Worker(cfg)
        log.info("worker %s: %s loaded in %.1f s", cfg.name, name, time.perf_counter() - started,
                 extra={"worker": cfg.name, "event": "model.loaded", "model": name})
        workers.append(worker)
    port = DEFAULT_PORTS[args.kind] if settings.metrics_port is None else settings.metrics_port
    for worker in workers:
        worker.metrics_port = None
        if port:
            try:       # a taken port moves on to the next free one: one /metrics per model
                worker.metrics_port = bind_metrics_server(port, worker.metrics.registry)
                port = worker.metrics_port + 1
            except OSError as exc:
                log.warning("worker %s: no /metrics: %s", worker.cfg.name, exc)
    stop = threading.Event()

    def _stop(*_):
        stop.set()
        for w in workers:
            w.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    threads = [threading.Thread(target=w.run, name=w.cfg.name, daemon=True) for w in workers]
    for name, worker, thread in zip(names, workers, threads):
        thread.start()
        print(json.dumps({"worker": worker.cfg.name, "kind": worker.cfg.kind, "device": worker.cfg.device,
                          "model": name, "source": worker.cfg.model, "queues": list(worker.cfg.queues),
                          "metrics_port": worker.metrics_port}), flush=True)
    while not stop.is_set() and all(t.is_alive() for t in threads):
        stop.wait(0.5)
    _stop()
    for t in threads:
        t.join(60)
    return 0


def register_first_start(engine, settings, actor: str = "serve") -> list[str]:
    """`tidepool serve` on an empty registry: register the default model (hot) and every other model folder in
    TIDEPOOL_MODELS_DIR (warm, named after its folder); returns the names registered (none after the first
    start: the registry is the operator's from then on)."""
    from pathlib import Path

    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from service import registry
    from service.models import Model
    with Session(engine) as s:
        if s.scalar(select(Model.name).limit(1)) is not None:
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
    (which the embedded gpu worker serves), named `<base_name>.<model>`; cold models wait for an operator."""
    from service.registry import Registry
    entries = Registry(engine, settings.served_model_name, settings.model).entries().values()
    names = [e.name for e in entries if e.enabled and e.tier != "cold" and e.name != settings.served_model_name]
    cfgs = model_configs(names, settings, "gpu", device, engine_overrides, base_name) if names else []
    if len(names) == 1:
        cfgs[0].name = f"{base_name}.{names[0]}"
    return cfgs
