"""Service subcommands of the `tidepool` CLI (ledger, tenants, keys, web). Never imports torch."""
import json


def register(sub) -> None:
    db = sub.add_parser("db", help="ledger database").add_subparsers(dest="db_command", required=True)
    db.add_parser("upgrade", help="run migrations to head").set_defaults(func=_db_upgrade)
    p = db.add_parser("downgrade", help="roll migrations back")
    p.add_argument("revision", nargs="?", default="base")
    p.set_defaults(func=_db_downgrade)
    p = db.add_parser("prune", help="drop the jobs of finished months before MONTH (their usage and files are kept)")
    p.add_argument("--before", required=True, metavar="MONTH",
                   help="YYYY-MM: months strictly before it go; at the latest the current month")
    p.set_defaults(func=_db_prune)

    tenants = sub.add_parser("tenants", help="tenants").add_subparsers(dest="tenants_command", required=True)
    p = tenants.add_parser("create", help="create a tenant; prints its id and a fresh API key as JSON")
    p.add_argument("name")
    p.add_argument("--weight", type=float, default=1.0)
    p.set_defaults(func=_tenants_create)
    p = tenants.add_parser("list", help="list tenants with their active key prefixes, as a JSON array")
    p.set_defaults(func=_tenants_list)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("create", help="issue a key for a tenant; prints it as JSON")
    p.add_argument("tenant_id")
    p.set_defaults(func=_keys_create)
    p = keys.add_parser("revoke", help="revoke a key by its visible prefix")
    p.add_argument("prefix")
    p.set_defaults(func=_keys_revoke)

    adapters = sub.add_parser("adapters", help="LoRA adapters over registered models").add_subparsers(
        dest="adapters_command", required=True)
    p = adapters.add_parser("register", help="register a PEFT adapter folder; prints it as JSON (a folder that does "
                            "not fit its base model is refused with the reason)")
    p.add_argument("name", help="the name requests put in `model`")
    p.add_argument("--base", required=True, help="the registered model it adapts")
    p.add_argument("--source", required=True, help="the folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--tenant", default=None, help="the owning tenant's id (default: shared, per allow-list)")
    p.add_argument("--pinned", action="store_true", help="never evicted from the workers' adapter slots")
    p.set_defaults(func=_adapters_register)
    p = adapters.add_parser("list", help="print the registered adapters as a JSON array")
    p.set_defaults(func=_adapters_list)

    p = sub.add_parser("web", help="run the API alone (werkzeug; use gunicorn 'tidepool.service.wsgi:app' in production)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=_web)


def register_models(models_sub) -> None:
    """`tidepool models register|registry|set`: the model registry (service/ledger/registry.py), beside pull and list."""
    p = models_sub.add_parser("register", help="register a model folder under a name requests can use")
    p.add_argument("name", help="the name requests put in `model`")
    p.add_argument("dir", help="the model folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--tier", choices=("hot", "warm", "cold"), default="warm",
                   help="hot: kept loaded; warm (default): loaded when its queue has work; cold: only on demand")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="the ranks its engines shard it over (GPUs, or sets of CPU cores); default "
                        "$TIDEPOOL_TENSOR_PARALLEL_SIZE, else 1")
    p.add_argument("--kv-cache-dtype", choices=registry_kv_dtypes(), default=None,
                   help="its KV cache element type; default $TIDEPOOL_KV_CACHE_DTYPE, else auto (the model's dtype)")
    p.set_defaults(func=_models_register)
    p = models_sub.add_parser("registry", help="print the registered models as a JSON array")
    p.set_defaults(func=_models_registry)
    p = models_sub.add_parser("warm", help="let the workers serving a (cold) model load it now (needs Redis)")
    p.add_argument("name")
    p.set_defaults(func=_models_warm)
    p = models_sub.add_parser("set", help="retier, enable, disable or resize a registered model")
    p.add_argument("name")
    p.add_argument("--tier", choices=("hot", "warm", "cold"))
    p.add_argument("--tensor-parallel-size", type=_size_or_default, default=None, metavar="N|default",
                   help="the ranks its engines shard it over; `default`: the deployment's, "
                        "$TIDEPOOL_TENSOR_PARALLEL_SIZE, else 1")
    p.add_argument("--kv-cache-dtype", choices=(*registry_kv_dtypes(), "default"), default=None,
                   help="its KV cache element type; `default`: the deployment's, $TIDEPOOL_KV_CACHE_DTYPE, else auto")
    p.add_argument("--enable", dest="enabled", action="store_true", default=None)
    p.add_argument("--disable", dest="enabled", action="store_false")
    p.set_defaults(func=_models_set)


def registry_kv_dtypes() -> tuple:
    from tidepool.service.ledger.registry import KV_CACHE_DTYPES
    return KV_CACHE_DTYPES


def _size_or_default(text: str):
    """`--tensor-parallel-size` of `models set`: a number of ranks, or "default" (the deployment's)."""
    return "default" if text == "default" else int(text)


def _model_json(row, cfg) -> dict:
    """What `models register` and `models set` print: the row, its tensor_parallel_size as the workers use it."""
    from tidepool.service.ledger import registry
    return {"name": row.name, "source": row.source, "tier": row.tier, "enabled": row.enabled,
            "tensor_parallel_size": registry.tensor_parallel_size(row.tensor_parallel_size, cfg.tensor_parallel_size),
            "kv_cache_dtype": registry.kv_cache_dtype(row.kv_cache_dtype, cfg.kv_cache_dtype)}


def _models_register(args) -> int:
    from pathlib import Path

    from tidepool.service.ledger import registry
    from tidepool.service.protocol.errors import APIError
    folder = Path(args.dir).expanduser()
    if not (folder / "config.json").is_file():
        return _fail(LookupError(f"{folder} is not a model folder (no config.json)"))
    with _session() as s:
        try:
            row = registry.register(s, args.name, str(folder.resolve()), args.tier, actor="cli",
                                    tensor_parallel_size=args.tensor_parallel_size,
                                    kv_cache_dtype=args.kv_cache_dtype)
        except APIError as exc:
            return _fail(exc)
        s.commit()
        print(json.dumps(_model_json(row, _config())))
    return 0


def _models_registry(args) -> int:
    from tidepool.service.ledger import registry
    cfg = _config()
    with _session() as s:
        entries = registry.Registry(s.get_bind(), cfg.served_model_name, cfg.model).entries().values()
        print(json.dumps([registry.entry_json(e, cfg.tensor_parallel_size, cfg.kv_cache_dtype) for e in entries]))
    return 0


def _models_warm(args) -> int:
    import time

    from tidepool.service.ledger import redis_conn, registry
    from tidepool.service.ledger.models import audit
    cfg = _config()
    if not cfg.redis_url:
        return _fail(LookupError("tidepool models warm needs TIDEPOOL_REDIS_URL (the workers' broker)"))
    with _session() as s:
        entry = registry.Registry(s.get_bind(), cfg.served_model_name, cfg.model).get(args.name)
        if entry is None or not entry.enabled:
            return _fail(LookupError(f"no enabled model named {args.name!r} is registered"))
        redis_conn.client(cfg.redis_url).set(registry.WARM_KEY.format(args.name), str(time.time()),
                                             ex=registry.WARM_TTL)
        audit(s, "cli", "model.warm", args.name)
        s.commit()
    print(json.dumps({"name": args.name, "warm": True, "for_seconds": registry.WARM_TTL}))
    return 0


def _models_set(args) -> int:
    from tidepool.service.ledger import registry
    from tidepool.service.protocol.errors import APIError
    values = {k: v for k, v in (("tier", args.tier), ("enabled", args.enabled)) if v is not None}
    if args.tensor_parallel_size is not None:
        values["tensor_parallel_size"] = None if args.tensor_parallel_size == "default" else args.tensor_parallel_size
    if args.kv_cache_dtype is not None:
        values["kv_cache_dtype"] = None if args.kv_cache_dtype == "default" else args.kv_cache_dtype
    cfg = _config()
    with _session() as s:
        default = registry.Registry(s.get_bind(), cfg.served_model_name, cfg.model).get(args.name)
        try:
            row = registry.update(s, args.name, values, actor="cli", default=default)
        except APIError as exc:
            return _fail(exc)
        s.commit()
        print(json.dumps(_model_json(row, cfg)))
    return 0


def _config():
    from tidepool.service.ledger.settings import Config
    return Config.from_env()


def _db_upgrade(args) -> int:
    import sys

    from tidepool.service import migrate
    from tidepool.service.ledger.database import ensure_database
    url = _config().database_url
    try:
        created = ensure_database(url)
    except RuntimeError as exc:
        print(f"tidepool db upgrade: {exc}", file=sys.stderr)
        return 1
    migrate.upgrade(url)
    print(json.dumps({"upgraded": "head", "created": created}))
    return 0


def _db_downgrade(args) -> int:
    from tidepool.service import migrate
    migrate.downgrade(_config().database_url, args.revision)
    print(json.dumps({"downgraded": args.revision}))
    return 0


def _db_prune(args) -> int:
    import sys

    from tidepool.service.ledger import partitions
    from tidepool.service.ledger.database import make_engine
    try:
        before = partitions.parse_month(args.before)
    except ValueError as exc:
        print(f"tidepool db prune: {exc}", file=sys.stderr)
        return 2
    engine = make_engine(_config().database_url)
    try:
        pruned = partitions.prune(engine, before)
    except partitions.Refused as exc:
        print(f"tidepool db prune: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    print(json.dumps({"pruned": pruned.months, "jobs": pruned.jobs}))
    return 0


def _adapters_register(args) -> int:
    from pathlib import Path

    from tidepool.service.ledger import adapters, registry
    from tidepool.service.protocol.errors import APIError
    cfg = _config()
    with _session() as s:
        base = registry.Registry(s.get_bind(), cfg.served_model_name, cfg.model).get(args.base)
        try:
            row = adapters.register(s, args.name, args.base, str(Path(args.source).expanduser().resolve()), base,
                                    cfg.max_lora_rank or adapters.DEFAULT_MAX_LORA_RANK, args.tenant, args.pinned,
                                    actor="cli")
        except APIError as exc:
            return _fail(exc)
        s.commit()
        print(json.dumps(adapters.adapter_json(row)))
    return 0


def _adapters_list(args) -> int:
    from tidepool.service.ledger import adapters
    with _session() as s:
        print(json.dumps([adapters.adapter_json(a) for a in adapters.listing(s)]))
    return 0


def _session():
    from tidepool.service.ledger.database import make_engine, session
    return session(make_engine(_config().database_url))


def _fail(exc) -> int:
    import sys
    print(json.dumps({"error": {"message": getattr(exc, "message", str(exc)), "code": getattr(exc, "code", None)}}),
          file=sys.stderr)
    return 1


def _tenants_create(args) -> int:
    from tidepool.service.ledger import tenants
    from tidepool.service.protocol.errors import APIError
    with _session() as s:
        try:
            tenant, key = tenants.create_tenant(s, args.name, args.weight, actor="cli")
        except APIError as exc:
            return _fail(exc)
        s.commit()
        print(json.dumps({"id": tenant.id, "name": tenant.name, "weight": tenant.weight, "api_key": key}))
    return 0


def _tenants_list(args) -> int:
    from tidepool.service.ledger import tenants
    with _session() as s:
        keys = tenants.live_key_prefixes(s)
        print(json.dumps([{"id": t.id, "name": t.name, "weight": t.weight, "disabled": t.disabled,
                           "default_sla_class": t.default_sla_class, "created_at": t.created_at.isoformat(),
                           "key_prefixes": keys.get(t.id, [])}
                          for t in tenants.by_name(s)]))
    return 0


def _keys_create(args) -> int:
    from tidepool.service.ledger import tenants
    from tidepool.service.ledger.models import Tenant
    with _session() as s:
        if s.get(Tenant, args.tenant_id) is None:
            return _fail(LookupError(f"no tenant {args.tenant_id}"))
        row, key = tenants.issue_key(s, args.tenant_id, actor="cli")
        s.commit()
        print(json.dumps({"tenant_id": args.tenant_id, "prefix": row.prefix, "api_key": key}))
    return 0


def _keys_revoke(args) -> int:
    from tidepool.service.ledger import tenants
    with _session() as s:
        if not tenants.revoke_key(s, args.prefix, actor="cli"):
            return _fail(LookupError(f"no active key with prefix {args.prefix}"))
        s.commit()
        print(json.dumps({"prefix": args.prefix, "revoked": True}))
    return 0


def _web(args) -> int:
    from tidepool.service import create_app
    create_app().run(host=args.host, port=args.port, threaded=True)
    return 0
