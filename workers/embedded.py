"""`tidepool serve`: the whole service in one process. The web app, the workers `tidepool worker --kind auto` runs
(one engine serving every class; a cpu worker beside it when the device is a GPU) and the upkeep loop run on
threads, over SQLite and kombu's in-process `memory://` transport unless TIDEPOOL_DATABASE_URL / TIDEPOOL_REDIS_URL
say otherwise. Same code paths as the Procfile processes; only the transport and the database URL differ."""
import dataclasses
import json
import logging
import secrets
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)
DEFAULT_MODEL = "smollm2-135m"


def _ensure_model(settings) -> str:
    if settings.model:
        return settings.model
    from tidepool.workers.tools.model_pull import pull_model
    path = Path(settings.models_dir) / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        print(f"No TIDEPOOL_MODEL set: fetching {DEFAULT_MODEL} once into {settings.models_dir}/ ...", flush=True)
        path = pull_model(DEFAULT_MODEL, settings.models_dir)
    return str(path)


def _secret_file(path: Path, make) -> str:
    if path.is_file():
        return path.read_text().strip()
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")
    path.chmod(0o600)
    return value


def _default_key(database, var: Path) -> str:
    """The `default` tenant and an API key for it, created on first run and kept in var/."""
    from tidepool.service.ledger import tenants
    from tidepool.service.ledger.database import session
    key_file = var / "default_api_key"
    with session(database) as s:
        tenant_id = tenants.id_by_name(s, "default")
        if tenant_id is None:
            _, key = tenants.create_tenant(s, "default", actor="serve")
        elif key_file.is_file():
            return key_file.read_text().strip()
        else:
            _, key = tenants.issue_key(s, tenant_id, actor="serve")
        s.commit()
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    return key


def http_server(app, host: str, port: int, threads: int):
    """waitress, a production WSGI server, with a bounded pool of request threads (a streaming response holds
    one for its length) and a bounded number of open connections; `.run()` serves, `.effective_port` is bound."""
    from waitress.server import create_server
    return create_server(app, host=host, port=port, threads=threads, connection_limit=max(100, 4 * threads),
                         channel_timeout=300, ident="tidepool")


def main(args) -> int:
    from tidepool.service import create_app, migrate
    from tidepool.service.ledger.settings import Config
    from tidepool.workers import beat
    from tidepool.workers.worker import Worker, WorkerConfig, default_device, host_workers, role

    var = Path("var")
    var.mkdir(exist_ok=True)
    cfg = Config.from_env()
    token_file = None if cfg.admin_token else var / "admin_token"
    # the default model and a kept admin token fill in what the environment leaves unset
    cfg = dataclasses.replace(cfg, model=_ensure_model(cfg), admin_token=cfg.admin_token or _secret_file(
        var / "admin_token", lambda: secrets.token_urlsafe(24)))
    model = cfg.model
    migrate.upgrade(cfg.database_url)
    app = create_app(cfg)
    if token_file is not None:       # the token is the one kept in var/: the sign-in page says where
        app.config["TIDEPOOL_ADMIN_TOKEN_FILE"] = str(token_file)
    key = _default_key(app.services.database, var)

    # the model registry: filled at the first start (the default model and TIDEPOOL_MODELS_DIR's folders); the
    # default model's workers take what its row carries (model_engine_fields), and every other enabled hot or warm
    # model whose weights fit the device gets a worker of its own
    from tidepool.workers.config_fields import model_engine_fields, refuse_unstartable
    from tidepool.workers.model_workers import other_model_configs, register_first_start
    register_first_start(app.services.database, cfg)
    own = model_engine_fields(app.services.registry.get(cfg.served_model_name))
    device = args.device or default_device()
    cfgs = []
    for kind, dev in host_workers("auto", device):
        wcfg = WorkerConfig.from_env(kind=kind, device=dev, settings=cfg, name=f"embedded-{role(kind, dev)}")
        wcfg.engine.update({**args.engine, **own})
        cfgs.append(wcfg)
    cfgs += other_model_configs(app.services.database, cfg, device, args.engine,
                                base_name=f"embedded-{role('gpu', device)}")
    on_cpu = [c for c in cfgs if c.device == "cpu"]
    for c in on_cpu if len(on_cpu) > 1 else ():     # their KV pools split the host's one budget evenly
        c.engine.setdefault("kv_share", 1 / len(on_cpu))
    for wcfg in cfgs:
        refuse_unstartable(wcfg.model, wcfg.device, wcfg.engine, "serve")
    workers = []
    for wcfg in cfgs:
        log.info("loading %s on %s for the %s worker", wcfg.model, wcfg.device, wcfg.name)
        workers.append(Worker(wcfg))
    on_device = [w for w in workers if w.cfg.kind == "gpu"]
    if len(on_device) > 1:       # several models share the device as a --models worker's do (device_stepper.py)
        from tidepool.workers.device_stepper import DeviceStepper
        stepper = DeviceStepper(offline_floor=min(w.engine.config.offline_floor for w in on_device))
        for w in on_device:
            w.stepper = stepper
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, name=w.cfg.name, daemon=True) for w in workers]
    threads.append(threading.Thread(target=beat.run_forever, args=(app.services,), daemon=True,
                                    kwargs={"interval": 2.0, "stop": stop, "republish_after": 5.0}))
    for t in threads:
        t.start()

    server = http_server(app, args.host, args.port, args.threads)
    base = f"http://{args.host}:{server.effective_port}"
    name = cfg.served_model_name
    print(f"""
Tidepool is serving {name} ({model}) on {device}.
  API        {base}/v1
  Admin      {base}/admin   (token: {cfg.admin_token})
  API key:   {key}

  curl {base}/v1/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})}'

  {sys.executable} -c 'from openai import OpenAI; c = OpenAI(base_url="{base}/v1", api_key="{key}"); \\
print(c.chat.completions.create(model="{name}", messages=[{{"role": "user", "content": "Hello!"}}], \\
max_tokens=32).choices[0].message.content)'
""", flush=True)

    def _shutdown(*_):
        raise KeyboardInterrupt     # ends server.run() in the main thread; the finally below stops the workers

    signal.signal(signal.SIGTERM, _shutdown)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        for w in workers:
            w.stop()
        for t in threads:
            t.join(15)
    return 0
