"""The LoRA adapter registry: PEFT folders over a registered model, owned by one tenant or shared. Flask- and
torch-free: the admin API and the CLI share it; every change is written to the audit log.

A tenant may use its own adapters and the shared ones its allow-list names (quota.allowed_models; NULL or [] means
every enabled model and shared adapter). Another tenant's adapter does not exist for it (404, never 403).
Registration reads the folder (adapter_config.json and the safetensors header, no weights) and refuses one that
does not fit its base model with the reason: the engine checks the same again when it loads it
(workers/engine/lora.py check_adapter), since a folder can change after registration."""
import json
import struct
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..protocol.errors import APIError, bad_request
from .models import Adapter, Tenant, audit, utcnow
from .registry import NAME, Entry, Registry, check_source

DEFAULT_MAX_LORA_RANK = 16    # EngineConfig.max_lora_rank's default, when TIDEPOOL_MAX_LORA_RANK is unset
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _module_dims(raw: dict) -> dict[str, tuple[int, int]]:
    h, i, heads = raw["hidden_size"], raw["intermediate_size"], raw["num_attention_heads"]
    d = raw.get("head_dim") or h // heads
    q, kv = heads * d, (raw.get("num_key_value_heads") or heads) * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def inspect_folder(source: str, base_source: str | None, max_lora_rank: int) -> tuple[int, list[str]]:
    """(rank, target modules) of a PEFT folder; 404 when there is none at `source`, 400 with the reason when it
    cannot run over the base model."""
    def refuse(why: str) -> APIError:
        return bad_request(f"The adapter folder does not fit its base model: {why}.", "source")
    folder = Path(source)
    try:
        config = (folder / "adapter_config.json").read_text()
    except OSError as e:        # nothing there (or nothing readable): no adapter at this path
        raise APIError(404, f"No adapter found at {source}: it needs a readable adapter_config.json ({e}).",
                       "not_found", "source") from None
    try:
        raw = json.loads(config)
        with open(folder / "adapter_model.safetensors", "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            shapes = {k: v["shape"] for k, v in json.loads(f.read(size)).items() if k != "__metadata__"}
    except (OSError, ValueError, struct.error) as e:
        raise refuse(f"it needs a readable adapter_config.json and adapter_model.safetensors ({e})") from None
    rank = raw.get("r")
    if raw.get("peft_type", "LORA") != "LORA" or not isinstance(rank, int) or rank < 1:
        raise refuse("it is not a LoRA adapter with a positive rank r")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} exceeds max_lora_rank {max_lora_rank}")
    for key in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise refuse(f"{key} is not supported")
    try:
        base = json.loads((Path(base_source) / "config.json").read_text()) if base_source else None
        dims, layers = (_module_dims(base), base["num_hidden_layers"]) if base else (None, None)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise refuse(f"the base model's config.json cannot be read ({e})") from None
    modules = set()
    for name, shape in shapes.items():
        parts = name.split(".")
        module = next((p for p in parts if p in TARGETS), None)
        if module is None or "layers" not in parts or parts[-3] not in ("lora_A", "lora_B") and parts[-2] not in (
                "lora_A", "lora_B"):
            raise refuse(f"tensor {name} is not a lora_A/lora_B of {', '.join(TARGETS)}")
        modules.add(module)
        if dims is None:
            continue
        layer = int(parts[parts.index("layers") + 1])
        if layer >= layers:
            raise refuse(f"{name} is for layer {layer}, the base model has {layers} layers")
        d_in, d_out = dims[module]
        want = [rank, d_in] if "lora_A" in parts else [d_out, rank]
        if list(shape) != want:
            raise refuse(f"{name} has shape {list(shape)}, the base model needs {want}")
    if not modules:
        raise refuse("it holds no lora_A/lora_B weights")
    return rank, [m for m in TARGETS if m in modules]


def adapter_json(a: Adapter) -> dict:
    return {"id": a.name, "object": "adapter", "base_model": a.base_model, "source": a.source,
            "tenant_id": a.tenant_id, "rank": a.rank, "target_modules": a.target_modules, "pinned": a.pinned,
            "enabled": a.enabled, "created": int(a.created_at.timestamp())}


def public_json(a: Adapter) -> dict:
    """The OpenAI model object a tenant sees for an adapter: its base as `parent` (as vLLM lists LoRA modules)."""
    return {"id": a.name, "object": "model", "created": int(a.created_at.timestamp()), "owned_by": "tidepool",
            "parent": a.base_model, "root": a.base_model}


def register(s: Session, name, base_model, source, base: Entry | None, max_lora_rank: int, tenant_id=None,
             pinned=False, enabled=True, actor: str = "admin") -> Adapter:
    """`base`: the registry entry of base_model (None: no such model, a 404)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request("An adapter name is 1 to 128 characters: letters, digits and . _ : - (starting with a "
                          "letter or digit).", "name")
    source = check_source(source)
    if base is None:
        raise APIError(404, f"The base model '{base_model}' is not registered.", "model_not_found", "base_model")
    for field, value in (("pinned", pinned), ("enabled", enabled)):
        if not isinstance(value, bool):
            raise bad_request(f"{field} must be a boolean.", field)
    if tenant_id is not None and (not isinstance(tenant_id, str) or s.get(Tenant, tenant_id) is None):
        raise APIError(404, f"No tenant found with id '{tenant_id}'.", "not_found", "tenant_id")
    if s.get(Adapter, name) is not None or base_model == name:
        raise APIError(409, f"A model or adapter named '{name}' is already registered.", "model_exists", "name")
    rank, modules = inspect_folder(source, base.source, max_lora_rank)
    now = utcnow()
    row = Adapter(name=name, base_model=base_model, source=source, tenant_id=tenant_id, rank=rank,
                  target_modules=modules, pinned=pinned, enabled=enabled, created_at=now, updated_at=now)
    s.add(row)
    audit(s, actor, "adapter.register", name, {"base_model": base_model, "source": source, "tenant_id": tenant_id,
                                               "pinned": pinned, "rank": rank, "target_modules": modules})
    return row


def update(s: Session, name: str, values: dict, actor: str = "admin") -> Adapter:
    """Pin or unpin, enable or disable (keys absent: unchanged)."""
    unknown = sorted(set(values) - {"pinned", "enabled"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    row = s.get(Adapter, name)
    if row is None:
        raise APIError(404, f"No adapter named '{name}' is registered.", "not_found", "name")
    for field in ("pinned", "enabled"):
        if field in values:
            if not isinstance(values[field], bool):
                raise bad_request(f"{field} must be a boolean.", field)
            setattr(row, field, values[field])
            audit(s, actor, f"adapter.{field}" if values[field] else f"adapter.un{field}", name)
    row.updated_at = utcnow()
    return row


def listing(s: Session) -> list[Adapter]:
    return list(s.scalars(select(Adapter).order_by(Adapter.name)))


def usable(s: Session, tenant_id: str, allowed: list | None) -> list[Adapter]:
    """The enabled adapters a tenant may use: its own, and the shared ones its allow-list permits."""
    rows = s.scalars(select(Adapter).where(Adapter.enabled.is_(True)).order_by(Adapter.name))
    return [a for a in rows if a.tenant_id == tenant_id or (a.tenant_id is None and (not allowed or a.name in allowed))]


def visible(s: Session, tenant_id: str, name: str) -> Adapter | None:
    """The adapter of this name if the tenant may know of it (its own or shared), else None: another tenant's
    adapter is answered exactly as a missing one."""
    row = s.get(Adapter, name)
    return row if row is not None and row.tenant_id in (None, tenant_id) else None


def resolve(s: Session, models: Registry, quota, tenant_id: str, requested) -> Entry:
    """The base model's entry of a request's `model`: a registered model, or an adapter this tenant may use (its
    own, or a shared one its allow-list permits); another tenant's adapter is as unknown as a missing model. The
    job keeps the adapter's name in its request (`model`) and runs on its base's queues."""
    if isinstance(requested, str) and models.get(requested) is None:
        row = visible(s, tenant_id, requested)
        if row is not None:
            if not row.enabled:
                raise APIError(403, f"The model '{requested}' is disabled.", "model_disabled", "model")
            if row.tenant_id is None and not Registry.permits(quota, row.name):
                raise APIError(403, f"This tenant may not use the model '{requested}'.", "model_not_allowed",
                               "model")
            return models.resolve(quota, row.base_model)
    return models.resolve(quota, requested)


class NotUsable(ValueError):
    """A job names an adapter its tenant may not use: it must not run with it (nor without it)."""
    code = "model_not_found"


def for_job(conn, tenant_id: str, allowed: list | None, model: str | None,
            request: dict) -> tuple[str, str, bool] | None:
    """(name, source, pinned) of the adapter a job's request names, None when it names its base model. The worker's
    own check of what admission checked (resolve), so a job row that names another tenant's adapter, a shared one
    outside the tenant's allow-list (`allowed`) or one over another base model never runs: NotUsable."""
    name = request.get("model") if isinstance(request, dict) else None
    if not isinstance(name, str) or name == model:
        return None
    row = conn.execute(select(Adapter.name, Adapter.source, Adapter.pinned, Adapter.tenant_id, Adapter.base_model)
                       .where(Adapter.name == name)).first()
    if row is None:
        return None
    if row.tenant_id not in (None, tenant_id) or row.tenant_id is None and allowed and name not in allowed:
        raise NotUsable(f"the model '{name}' does not exist")
    if model is not None and row.base_model != model:
        raise NotUsable(f"the adapter '{name}' is over '{row.base_model}', not '{model}'")
    return row.name, row.source, bool(row.pinned)
