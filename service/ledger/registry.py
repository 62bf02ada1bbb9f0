"""The model registry: which models the service serves, from which folder, how workers keep them (tier), and
which tenants may use them. Flask- and torch-free: the admin API, the panel, the CLI and the workers share it;
every change is written to the audit log.

The deployment's default model (TIDEPOOL_MODEL, named TIDEPOOL_SERVED_MODEL_NAME or its folder's name) is served
whether or not it has a row: without one it counts as registered, hot and enabled; a row of that name overrides
it (an admin can retier or disable it). A tenant's quota.allowed_models lists the models it may use; NULL or an
empty list means every enabled model.

Each web process reads the table at most once per CACHE_TTL seconds; a change committed through this process
(admin API, panel) is seen at once, one made elsewhere (CLI, another web process) within CACHE_TTL."""
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import event, select
from sqlalchemy.orm import Session

from ..protocol.errors import APIError, bad_request
from .models import Model, ModelTier, Quota, Tenant, audit, utcnow

# '@' never appears: it separates class and model in queue names (service/ledger/dispatch.py queue_name).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
TIERS = tuple(t.value for t in ModelTier)
CACHE_TTL = 2.0
# `tidepool models warm NAME` sets this Redis key (for WARM_TTL seconds): workers serving the cold model may load it
WARM_KEY = "tidepool:model_warm:{}"
WARM_TTL = 3600
# Redis hash: worker process name -> JSON {"queues": [...], "at": Unix seconds}: the queues a model host
# (workers/model_workers.py) serves, its unloaded warm models' included, since it loads them when work arrives.
HOSTS_KEY = "tidepool:model_hosts"


def hosted_queues(redis_client, max_age: float, now: float | None = None) -> set[str]:
    """Queues that live model hosts will serve (loaded or not); empty without Redis."""
    if redis_client is None:
        return set()
    now = time.time() if now is None else now
    out: set[str] = set()
    for raw in redis_client.hvals(HOSTS_KEY):
        entry = json.loads(raw)
        if now - entry.get("at", 0) <= max_age:
            out.update(entry.get("queues", []))
    return out
MAX_ALLOWED = 1000   # names in one allow-list


@dataclass(frozen=True)
class Entry:
    name: str | None
    source: str | None
    tier: str
    enabled: bool
    created: int          # Unix seconds: registration, or (implicit default model) its folder's config.json
    registered: bool      # False: the default model, served without a row
    tensor_parallel_size: int | None = None    # its own; None: the deployment's (see tensor_parallel_size())
    kv_cache_dtype: str | None = None          # its own; None: the deployment's (see kv_cache_dtype())
    kv_cache_calibration: dict | None = None   # `tidepool models calibrate-kv`'s record (scales, figures per dtype)


# What resolve() gives when there is nothing to check against (no default model, no registered model): the
# job runs on whatever model the class queues' workers load, as before the registry.
UNCHECKED = Entry(None, None, ModelTier.hot.value, True, 0, False)


def tensor_parallel_size(own: int | None, deployment: int | None = None) -> int:
    """The ranks a model's engines shard it over: its own size, else the deployment's (TIDEPOOL_TENSOR_PARALLEL_SIZE),
    else the engine's default, 1."""
    return own or deployment or 1


KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")     # kernels/kv_quant.py's, which the engine checks


def kv_cache_dtype(own: str | None, deployment: str | None = None) -> str:
    """The KV cache dtype a model's engines ask for: its own, else the deployment's (TIDEPOOL_KV_CACHE_DTYPE), else
    `auto`. Whether the engine keeps it is the calibration's verdict (kv_cache_use)."""
    return own or deployment or "auto"


def kv_cache_use(e: Entry, deployment: str | None = None) -> dict:
    """What the Models page and `models registry` show of a model's KV cache: the dtype asked for, the one its
    engines run with (`auto` where the calibration refused it: its figures' `refused`, set by the engine's guard)
    and the measured loss."""
    asked = kv_cache_dtype(e.kv_cache_dtype, deployment)
    figures = ((e.kv_cache_calibration or {}).get("accuracy") or {}).get(asked)
    refused = bool(figures and figures.get("refused"))
    return {"kv_cache_dtype": asked, "kv_cache_dtype_in_use": "auto" if refused else asked,
            "kv_cache_loss": figures.get("loss") if figures else None}


def entry_json(e: Entry, deployment_tensor_parallel_size: int | None = None,
               deployment_kv_cache_dtype: str | None = None) -> dict:
    return {"id": e.name, "object": "model", "created": e.created, "owned_by": "tidepool", "source": e.source,
            "tier": e.tier, "enabled": e.enabled, "registered": e.registered, "kind": folder_kind(e.source),
            "tensor_parallel_size": tensor_parallel_size(e.tensor_parallel_size, deployment_tensor_parallel_size),
            **kv_cache_use(e, deployment_kv_cache_dtype)}


def public_json(e: Entry) -> dict:
    """The OpenAI model object a tenant sees (no folder, tier or state)."""
    return {"id": e.name, "object": "model", "created": e.created, "owned_by": "tidepool"}


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request("A model name is 1 to 128 characters: letters, digits and . _ : - (starting with a "
                          "letter or digit).", "name")
    return name


def check_tier(tier) -> str:
    if tier not in TIERS:
        raise bad_request(f"tier must be one of {list(TIERS)}.", "tier")
    return tier


def check_source(source) -> str:
    if not isinstance(source, str) or not source or len(source) > 1024 or "\x00" in source \
            or not os.path.isabs(source):
        raise bad_request("source must be the absolute path of the model folder (at most 1024 characters).",
                          "source")
    return source


MAX_TENSOR_PARALLEL_SIZE = 64


def check_tensor_parallel_size(value) -> int | None:
    """A model's own tensor_parallel_size: None (the deployment's) or a whole number of ranks; whether the model's
    heads split that way is the engine's to say, where a worker loads it."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 1 <= value <= MAX_TENSOR_PARALLEL_SIZE):
        raise bad_request(f"tensor_parallel_size must be null (the deployment's) or an integer in [1, "
                          f"{MAX_TENSOR_PARALLEL_SIZE}].", "tensor_parallel_size")
    return value


def check_kv_cache_dtype(value) -> str | None:
    if value is not None and value not in KV_CACHE_DTYPES:
        raise bad_request(f"kv_cache_dtype must be null (the deployment's) or one of {list(KV_CACHE_DTYPES)}.",
                          "kv_cache_dtype")
    return value


def _row(s: Session, name: str, actor: str, default: Entry | None) -> Model:
    """The model's row; the implicit default model gets its row here."""
    row = s.get(Model, name)
    if row is None:
        if default is None or default.registered or default.name != name:
            raise APIError(404, f"No model named '{name}' is registered.", "model_not_found", "name")
        row = register(s, name, default.source, default.tier, True, actor=actor)
        s.flush()
    return row


def set_kv_calibration(s: Session, name: str, record: dict, actor: str = "cli", default: Entry | None = None) -> Model:
    """Store `tidepool models calibrate-kv`'s record with the model (the implicit default model gets its row)."""
    row = _row(s, name, actor, default)
    row.kv_cache_calibration = record
    row.updated_at = utcnow()
    audit(s, actor, "model.calibrate_kv", name, {dtype: {k: v for k, v in f.items() if k in ("loss", "refused")}
                                                 for dtype, f in (record.get("accuracy") or {}).items()})
    _dirty(s)
    return row


def check_allowed(value) -> list | None:
    """A quota's allowed_models: None, or a list of model names (registered or not yet)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_ALLOWED:
        raise bad_request(f"allowed_models must be null or a list of at most {MAX_ALLOWED} model names.",
                          "allowed_models")
    for name in value:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad_request(f"allowed_models holds {name!r}, which is not a model name.", "allowed_models")
    return sorted(set(value))


def _dirty(s: Session) -> None:
    s.info["tp_models_dirty"] = True


def is_empty(s: Session) -> bool:
    return s.scalar(select(Model.name).limit(1)) is None


def register(s: Session, name, source, tier="warm", enabled=True, actor: str = "admin",
             tensor_parallel_size=None, kv_cache_dtype=None) -> Model:
    name, source, tier = check_name(name), check_source(source), check_tier(tier)
    tensor_parallel_size = check_tensor_parallel_size(tensor_parallel_size)
    kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
    if not isinstance(enabled, bool):
        raise bad_request("enabled must be a boolean.", "enabled")
    if s.get(Model, name) is not None:
        raise APIError(409, f"A model named '{name}' is already registered.", "model_exists", "name")
    now = utcnow()
    row = Model(name=name, source=source, tier=tier, enabled=enabled, tensor_parallel_size=tensor_parallel_size,
                kv_cache_dtype=kv_cache_dtype, created_at=now, updated_at=now)
    s.add(row)
    sized = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size else {}
    if kv_cache_dtype:
        sized["kv_cache_dtype"] = kv_cache_dtype
    audit(s, actor, "model.register", name, {"source": source, "tier": tier, "enabled": enabled, **sized})
    _dirty(s)
    return row


def update(s: Session, name: str, values: dict, actor: str = "admin", default: Entry | None = None) -> Model:
    """Retier, enable/disable, re-point a model or set its tensor_parallel_size (None: the deployment's); keys
    absent: unchanged. The implicit default model gets its row here, with the change applied."""
    unknown = sorted(set(values) - {"tier", "enabled", "source", "tensor_parallel_size", "kv_cache_dtype"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    row = _row(s, name, actor, default)
    if "tier" in values:
        row.tier = check_tier(values["tier"])
        audit(s, actor, "model.retier", name, {"tier": row.tier})
    if "enabled" in values:
        if not isinstance(values["enabled"], bool):
            raise bad_request("enabled must be a boolean.", "enabled")
        row.enabled = values["enabled"]
        audit(s, actor, "model.enable" if row.enabled else "model.disable", name)
    if "source" in values:
        row.source = check_source(values["source"])
        audit(s, actor, "model.update", name, {"source": row.source})
    if "tensor_parallel_size" in values:
        row.tensor_parallel_size = check_tensor_parallel_size(values["tensor_parallel_size"])
        audit(s, actor, "model.update", name, {"tensor_parallel_size": row.tensor_parallel_size})
    if "kv_cache_dtype" in values:
        row.kv_cache_dtype = check_kv_cache_dtype(values["kv_cache_dtype"])
        audit(s, actor, "model.update", name, {"kv_cache_dtype": row.kv_cache_dtype})
    row.updated_at = utcnow()
    _dirty(s)
    return row


def grant(s: Session, tenant_id: str, name: str, actor: str = "admin") -> Quota:
    """Add a model to the tenant's allow-list. A tenant without a list may already use every model: nothing
    changes then (granting does not narrow what it may use)."""
    name = check_name(name)
    quota = s.get(Quota, tenant_id)
    if quota.allowed_models:
        quota.allowed_models = sorted(set(quota.allowed_models) | {name})
    audit(s, actor, "model.grant", tenant_id, {"model": name})
    return quota


def revoke(s: Session, tenant_id: str, name: str, everything: list[str], actor: str = "admin") -> Quota:
    """Take a model from the tenant's allow-list. A tenant without a list gets one: every model in `everything`
    (the registry) but this one. An allow-list is never left empty, since empty means every model: revoking
    the last model is refused (disable the tenant instead)."""
    name = check_name(name)
    quota = s.get(Quota, tenant_id)
    current = quota.allowed_models or everything
    left = sorted(set(current) - {name})
    if not left:
        raise APIError(409, f"'{name}' is the last model this tenant may use, and an empty allow-list means every "
                            "model; disable the tenant instead.", "last_model", "model")
    quota.allowed_models = left
    audit(s, actor, "model.revoke", tenant_id, {"model": name})
    return quota


def grants(s: Session) -> list[tuple[str, str, list | None]]:
    """(tenant id, tenant name, allowed_models) of every tenant, by name: who may use which model."""
    return s.execute(select(Tenant.id, Tenant.name, Quota.allowed_models).join(Quota, Quota.tenant_id == Tenant.id)
                     .order_by(Tenant.name)).all()


# ---- reading, cached per process ---------------------------------------------------------------------------

_generation = 0
_generation_lock = threading.Lock()


@event.listens_for(Session, "after_commit")
def _after_commit(session):
    global _generation
    if session.info.pop("tp_models_dirty", False):
        with _generation_lock:
            _generation += 1


@event.listens_for(Session, "after_rollback")
def _after_rollback(session):
    session.info.pop("tp_models_dirty", None)


def folder_created(folder: str | None) -> int:
    """When a model folder was written (its config.json), else now."""
    try:
        return int(os.stat(os.path.join(folder, "config.json")).st_mtime)
    except (OSError, TypeError):
        return int(time.time())


KINDS = ("generate", "embed")


def folder_kind(folder: str | None) -> str:
    """What a model folder serves: "embed" for a sentence-transformers folder (modules.json) or a BERT encoder,
    else "generate" (also when the folder cannot be read here)."""
    if not folder:
        return "generate"
    path = Path(folder)
    if (path / "modules.json").is_file():
        return "embed"
    try:
        return "embed" if json.loads((path / "config.json").read_text()).get("model_type") == "bert" else "generate"
    except (OSError, ValueError):
        return "generate"


def folder_context_len(folder: str | None, max_model_len: int | None = None) -> int | None:
    """Longest prompt + output for a model folder: max_model_len (TIDEPOOL_MAX_MODEL_LEN) when set, else its
    config.json (capped at a sliding window); None when the folder cannot be read here."""
    if max_model_len:
        return max_model_len
    if not folder:
        return None
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    limits = [raw.get("max_position_embeddings"), raw.get("sliding_window")]
    return min((v for v in limits if isinstance(v, int) and v > 0), default=None)


def folder_vocab_size(folder: str | None) -> int | None:
    """The model folder's vocabulary size (config.json `vocab_size`): token ids run from 0 to it, exclusive; None
    when the folder cannot be read here."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text()) if folder else None
    except (OSError, ValueError):
        return None
    value = raw.get("vocab_size") if isinstance(raw, dict) else None
    return value if isinstance(value, int) and value > 0 else None


class Registry:
    """The registered models of one ledger, plus the implicit default model, read at most once per ttl."""

    def __init__(self, engine, default_name: str | None = None, default_source: str | None = None,
                 ttl: float = CACHE_TTL, max_model_len: int | None = None):
        self.engine, self.default_name, self.default_source, self.ttl = engine, default_name, default_source, ttl
        self.max_model_len = max_model_len     # TIDEPOOL_MAX_MODEL_LEN: caps every model's context
        self._cached: tuple[int, float, dict[str, Entry]] | None = None
        self._default_created = folder_created(default_source) if default_name else 0
        self._context: dict = {}      # per model: context length, kind, dimensions

    def entries(self) -> dict[str, Entry]:
        """Every model by name, enabled or not."""
        cached = self._cached
        if cached is not None and cached[0] == _generation and cached[1] > time.monotonic():
            return cached[2]
        generation = _generation
        with self.engine.connect() as conn:   # autocommit: no write lock on SQLite, nothing held open
            columns = (Model.name, Model.source, Model.tier, Model.enabled, Model.created_at,
                       Model.tensor_parallel_size, Model.kv_cache_dtype, Model.kv_cache_calibration)
            rows = conn.execution_options(isolation_level="AUTOCOMMIT").execute(select(*columns)
                                                                                .order_by(Model.name)).all()
        out = {r.name: Entry(r.name, r.source, r.tier, bool(r.enabled), int(r.created_at.timestamp()), True,
                             r.tensor_parallel_size, r.kv_cache_dtype, r.kv_cache_calibration) for r in rows}
        if self.default_name and self.default_name not in out:
            out[self.default_name] = Entry(self.default_name, self.default_source, ModelTier.hot.value, True,
                                           self._default_created, False)
        self._cached = (generation, time.monotonic() + self.ttl, out)
        return out

    def get(self, name: str) -> Entry | None:
        return self.entries().get(name)

    @staticmethod
    def permits(quota: Quota | None, name: str) -> bool:
        allowed = quota.allowed_models if quota is not None else None
        return not allowed or name in allowed

    def allowed(self, quota: Quota | None) -> list[Entry]:
        """The enabled models this tenant may use, by name."""
        return [e for e in self.entries().values() if e.enabled and self.permits(quota, e.name)]

    def resolve(self, quota: Quota | None, requested: str | None) -> Entry:
        """The model a request names (none: the default model), or the client's error: 404 when no such model
        is registered, 403 when it is disabled or this tenant may not use it."""
        if requested is not None and not isinstance(requested, str):
            raise bad_request("'model' must be a string.", "model")
        entries = self.entries()
        if not entries:
            return UNCHECKED
        if requested is None:
            if not self.default_name:
                raise bad_request("'model' is required: this service has no default model.", "model",
                                  "missing_required_parameter")
            requested = self.default_name
        entry = entries.get(requested)
        if entry is None:
            raise APIError(404, f"The model '{requested}' does not exist.", "model_not_found", "model")
        if not entry.enabled:
            raise APIError(403, f"The model '{requested}' is disabled.", "model_disabled", "model")
        if not self.permits(quota, entry.name):
            raise APIError(403, f"This tenant may not use the model '{requested}'.", "model_not_allowed", "model")
        return entry

    def kind(self, entry: Entry) -> str | None:
        """"generate" or "embed" (registry.folder_kind); None when there is no model to ask (UNCHECKED)."""
        if entry.name is None:
            return None
        return self._per_model("kind", entry, folder_kind)

    def check_endpoint(self, entry: Entry, endpoint: str) -> None:
        """A 404 naming `model` when the model cannot serve the endpoint (an embedding model asked to generate,
        a generation model asked to embed): as OpenAI, no such model for this endpoint."""
        from ..protocol import EMBEDDINGS
        kind = self.kind(entry)
        if kind is None or (kind == "embed") == (endpoint == EMBEDDINGS):
            return
        if kind == "embed":
            raise APIError(404, f"The model '{entry.name}' is an embedding model: use /v1/embeddings with it.",
                           "model_not_supported", "model")
        raise APIError(404, f"The model '{entry.name}' does not serve /v1/embeddings: it generates text.",
                       "model_not_supported", "model")

    def embed_model(self, entry: Entry):
        """The embedding model's embeddings.EmbedModel (dimensions, tokenizer, max_seq_length); None for a model
        that does not embed or whose folder cannot be read here (then the worker checks the inputs)."""
        if entry.name is None or self.kind(entry) != "embed":
            return None
        from ..protocol.embeddings import EmbedModel
        return self._per_model("embed", entry, EmbedModel, or_none=True)   # unreadable: the worker refuses it

    def token_counter(self, entry: Entry):
        """text -> tokens with a generation model's tokenizer (tokenizer.json, read here once); None when this
        process cannot read it (then the API estimates from UTF-8 bytes, service/protocol/request_bodies.py)."""
        if entry.name is None or self.kind(entry) != "generate":
            return None
        def counter(source: str):
            from tokenizers import Tokenizer
            tokenizer = Tokenizer.from_file(str(Path(source) / "tokenizer.json"))
            return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
        return self._per_model("tokens", entry, counter, or_none=True)

    def vocab_size(self, entry: Entry) -> int | None:
        """Token ids the model knows (0 to this, exclusive); None when its folder cannot be read here."""
        if entry.name is None:
            return None
        return self._per_model("vocab", entry, folder_vocab_size)

    def _per_model(self, what: str, entry: Entry, read, or_none: bool = False):
        """read(entry.source), once per model folder; with or_none, None where the folder cannot be read here."""
        key = (what, entry.name, entry.source)
        if key not in self._context:
            try:
                self._context[key] = read(entry.source)
            except Exception:     # noqa: BLE001 - what this process cannot read, the worker checks
                if not or_none:
                    raise
                self._context[key] = None
        return self._context[key]

    def context_len(self, entry: Entry) -> int | None:
        if entry.name is None:
            return folder_context_len(None, self.max_model_len)
        if entry.name not in self._context:
            self._context[entry.name] = folder_context_len(entry.source, self.max_model_len)
        return self._context[entry.name]
