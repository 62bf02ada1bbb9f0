"""Engine-side subcommands of the `tidepool` CLI. Imports of torch and the engine stay inside the handlers."""
import json
import sys

from tidepool.service.ledger.settings import INT, Config, engine_flags


def register(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="write a seeded random-weight model (HF layout) for tests")
    p.add_argument("dir", help="output folder")
    p.add_argument("--arch", choices=("llama", "mistral", "qwen2"), default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=make_tiny_model)

    p = sub.add_parser("run-batch", help="run an OpenAI Batch JSONL file through the engine, offline")
    p.add_argument("-i", "--input", required=True, help="input JSONL (custom_id, method, url, body per line)")
    p.add_argument("-o", "--output", required=True, help="output JSONL (OpenAI Batch output format)")
    p.add_argument("--model", default=None, help="model folder (default: $TIDEPOOL_MODEL)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    add_engine_flags(p)
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="a LoRA adapter (PEFT folder) that lines naming NAME in `model` run with; repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_batch)

    models = sub.add_parser("models", help="the models folder ($TIDEPOOL_MODELS_DIR, default ./models) and the "
                                           "model registry in the ledger")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    p = models_sub.add_parser("pull", help="download a known model once and write it as an HF folder")
    p.add_argument("name", help="e.g. smollm2-135m")
    p.set_defaults(func=models_pull)
    p = models_sub.add_parser("list", help="list the model folders present")
    p.set_defaults(func=models_list)
    p = models_sub.add_parser("calibrate-kv", help="measure a model's KV cache scales and each quantized dtype's "
                                                   "accuracy; store them in its folder and the registry")
    p.add_argument("name", help="a registered model (or the default model), or a model folder")
    p.add_argument("--data", default=None, metavar="FILE.jsonl",
                   help="calibration text, one JSON object a line (text, prompt or messages); default: the built-in "
                        "set shipped with the package")
    p.add_argument("--samples", type=int, default=1000, help="calibration samples (of up to 64 tokens) at most")
    p.add_argument("--dtype", default=None, help="the model's dtype while calibrating (default: the engine's)")
    p.set_defaults(func=models_calibrate_kv)
    from tidepool.service import commands as service_commands
    service_commands.register_models(models_sub)

    register_processes(sub)


def register_processes(sub) -> None:
    """The long-running processes of the Procfile, and the embedded all-in-one."""
    p = sub.add_parser("worker", help="a gpu or cpu inference worker consuming the SLA queues")
    p.add_argument("--kind", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: every class on this host's device, plus a cpu worker (deferrable) beside it where "
                        "that device is a GPU, so a host without one runs one engine; gpu: all four queues, offline "
                        "ones only with spare capacity; cpu: deferrable only")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--models", default=None, metavar="A,B",
                   help="registered models to serve, one engine each (default: every enabled registered model whose "
                        "weights fit the memory budget; just the TIDEPOOL_MODEL folder when no other is registered)")
    p.add_argument("--memory-budget-mb", type=float, default=None, metavar="MB",
                   help="weights of the loaded models at most this; warm and cold models are unloaded least "
                        "recently busy first to make room (default: the device's memory: a GPU's total, on the CPU "
                        "what is available at start)")
    add_engine_flags(p)
    p.set_defaults(func=lambda args: _run("tidepool.workers.model_workers", "main", args))
    p = sub.add_parser("beat", help="Celery beat + upkeep: sweeper and batch finaliser (needs Redis)")
    p.set_defaults(func=lambda args: _run("tidepool.workers.celery_app", "main_beat", args))
    p = sub.add_parser("serve", help="all in one process: web, workers, upkeep (SQLite + in-process queue)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=32, help="HTTP request threads (each open stream holds one)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    add_engine_flags(p)
    p.set_defaults(func=lambda args: _run("tidepool.workers.embedded", "main", args))


# Engine knobs shared by worker, serve and run-batch: flag, else its setting (variable), else the engine's default.
def add_engine_flags(p) -> None:
    for flag, field, env, meaning in engine_flags():
        parse = Config.__dataclass_fields__[field].metadata["parse"]
        p.add_argument(flag, dest=field, type=int if parse is INT else parse, default=None,
                       help=f"{meaning}; default ${env}")


def engine_overrides(args) -> dict:
    """EngineConfig fields the flags set (laid over the settings' engine fields); unset ones are left out."""
    return {field: getattr(args, field) for _, field, _, _ in engine_flags()
            if getattr(args, field, None) is not None}


def _run(module: str, func: str, args) -> int:
    import importlib
    args.engine = engine_overrides(args)
    return getattr(importlib.import_module(module), func)(args)


def make_tiny_model(args) -> int:
    from tidepool.workers.tools.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(out)
    return 0


def models_pull(args) -> int:
    """Pull a known model; an embedding model is also registered under its name (kind embed, from its folder),
    when the ledger is reachable and it is not registered yet."""
    from tidepool.workers.tools.model_pull import FOLDER_ZIPS, MODELS, pull_model

    if args.name not in MODELS:
        print(f"unknown model {args.name!r}; known: {', '.join(sorted(MODELS))}", file=sys.stderr)
        return 2
    folder = pull_model(args.name, _models_dir())
    if args.name in FOLDER_ZIPS:

        from tidepool.service.ledger import registry
        from tidepool.service.ledger.settings import Config
        from tidepool.service.ledger.database import make_engine, session
        try:
            with session(make_engine(Config.from_env().database_url)) as s:
                if s.get(registry.Model, args.name) is None:
                    registry.register(s, args.name, str(folder.resolve()), actor="cli")
                    s.commit()
            print(json.dumps({"registered": args.name, "source": str(folder.resolve()),
                              "kind": registry.folder_kind(str(folder))}))
        except Exception as exc:      # noqa: BLE001 - no ledger yet: the folder is there, register it later
            print(f"{args.name}: not registered ({exc.__class__.__name__}); run `tidepool db upgrade` and "
                  f"`tidepool models register {args.name} {folder}`", file=sys.stderr)
    return 0


def models_list(args) -> int:
    from tidepool.workers.tools.model_pull import list_models

    root = _models_dir()
    for name in list_models(root):
        print(root / name)
    return 0


def models_calibrate_kv(args) -> int:
    """Calibrate NAME's KV cache: the folder's kv_cache_scales.json, and the registry's copy when NAME is a registered
    (or the default) model and the ledger is reachable."""
    from pathlib import Path

    from tidepool.service.ledger import registry
    from tidepool.service.ledger.database import make_engine, session
    from tidepool.service.ledger.settings import Config
    from tidepool.workers.tools.kv_calibrate import calibrate_folder

    cfg = Config.from_env()
    folder, entry, db = Path(args.name).expanduser(), None, None
    if not (folder / "config.json").is_file():
        try:
            db = make_engine(cfg.database_url)
            entry = registry.Registry(db, cfg.served_model_name, cfg.model).get(args.name)
        except Exception as exc:      # noqa: BLE001 - no ledger: the name can only be a folder
            print(f"tidepool models calibrate-kv: {args.name!r} is no model folder and the registry is unreachable "
                  f"({exc.__class__.__name__})", file=sys.stderr)
            return 2
        if entry is None or not entry.source:
            print(f"tidepool models calibrate-kv: no model named {args.name!r}", file=sys.stderr)
            return 2
        folder = Path(entry.source)
    record = calibrate_folder(folder, args.data, args.samples, args.dtype)
    if entry is not None:
        with session(db) as s:
            registry.set_kv_calibration(s, args.name, record, actor="cli", default=entry)
            s.commit()
    summary = {dtype: {k: round(v, 5) if isinstance(v, float) else v for k, v in f.items()}
               for dtype, f in record["accuracy"].items()}
    print(json.dumps({"model": args.name, "folder": str(folder), "file": str(folder / "kv_cache_scales.json"),
                      "registry": entry is not None, "samples": record["samples"], "tokens": record["tokens"],
                      "heldout_tokens": record["heldout_tokens"], "seconds": record["seconds"],
                      "accuracy": summary}))
    return 0


def _models_dir():
    from pathlib import Path

    from tidepool.service.ledger.settings import Config
    return Path(Config.setting("models_dir"))


def run_batch(args) -> int:
    import json
    import logging
    from pathlib import Path

    log = logging.getLogger("tidepool.run_batch")
    log.info("run-batch: starting (torch, the model, the KV pool and the native kernel load first)")
    import torch

    from tidepool.service.ledger.settings import Config
    from tidepool.workers.batch_runner import run_batch
    from tidepool.workers.engine import EngineConfig, LLMEngine, LoRARequest
    from tidepool.workers.config_fields import engine_fields, refuse_unstartable

    settings = Config.from_env()
    model = args.model or settings.model
    if not model:
        print("no model: pass --model DIR or set TIDEPOOL_MODEL", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loras = {}
    for spec in args.adapter:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            print(f"--adapter takes NAME=DIR, got {spec!r}", file=sys.stderr)
            return 2
        loras[name] = LoRARequest(name, str(Path(folder).expanduser().resolve()))
    fields = {**engine_fields(settings, device), **engine_overrides(args)}
    if loras and not fields.get("max_loras"):
        fields["max_loras"] = min(len(loras), 8)
    # Only batch lines come through here, as through LLM: no online reserve and no step bounded in time for online work.
    fields = {**fields, "online_reserve": 0.0, "sla_targets": {}}
    refuse_unstartable(model, device, fields, "run-batch")
    engine = LLMEngine(EngineConfig(model=model, device=device, **fields))
    log.info("run-batch: engine ready; reading %s", args.input)
    counts = run_batch(engine, args.input, args.output, Path(model).name, progress=not args.no_progress,
                       adapters=loras)
    print(json.dumps(counts))
    return 0
