"""Per-request LoRA adapters over one base model (Punica / S-LoRA): many fine-tunes in one continuous batch.

An adapter is a folder in PEFT format (adapter_config.json + adapter_model.safetensors) whose lora_A / lora_B
weights target any of the q/k/v/o/gate/up/down projections. `check_adapter` reads only the config and the
safetensors header and refuses a folder that does not fit the base model (dimensions, modules, layers, rank above
max_lora_rank) with the reason.

LoRAManager owns the slot pool: `max_loras` device slots, every adapter padded to `max_lora_rank`, stacked the way
the model stacks its projections (q/k/v into qkv_proj, gate/up into gate_up_proj: one shrink and one expand per
stacked linear, the B of a stack block-diagonal, the adapter's scale folded into B). Host copies of at most
`max_cpu_loras` adapters are read from disk on a background thread, so a request whose adapter is loading waits
without holding up the step. A slot is taken when a step needs it, from the least recently used adapter that no
running sequence uses; pinned adapters are loaded at once and never leave their slot or the host. The scheduler
admits a sequence only when its adapter is on the host and a slot is (or can be made) free for it.
"""
import json
import logging
import math
import re
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tidepool.kernels.lora_ops import make_plan, sgmv
from tidepool.workers.engine.models.model_config import ModelConfig
from tidepool.workers.engine.models.sharding import RowParallelLinear, Shard, WeightSlicer
from tidepool.workers.engine.openmp import release_team

log = logging.getLogger(__name__)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the model's (stacked) linear -> the checkpoint projections it holds, in output order
STACKS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)"
                 r"\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "modules_to_save": "modules_to_save",
               "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)"}


class LoRAError(ValueError):
    """An adapter folder the engine cannot serve over its base model (the message says why)."""


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with: its name (the key of caches and slots) and PEFT folder."""
    name: str
    path: str
    pinned: bool = False


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    scale: float
    modules: tuple[str, ...]
    layers: tuple[int, ...]


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of every projection an adapter may target."""
    h, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the file's header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def check_adapter(folder: str | Path, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """The adapter's rank, scale and modules; LoRAError with the reason if it cannot run over this base model."""
    folder = Path(folder)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for p in (config_path, weights_path):
        if not p.is_file():
            raise LoRAError(f"{p} not found: a PEFT adapter folder needs adapter_config.json and "
                            "adapter_model.safetensors")
    try:
        raw = json.loads(config_path.read_text())
        shapes = safetensors_shapes(weights_path)
    except (OSError, ValueError, struct.error) as e:
        raise LoRAError(f"adapter files of {folder} cannot be read: {e}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"peft_type {raw.get('peft_type')!r} is not LORA")
    for key, what in UNSUPPORTED.items():
        if raw.get(key):
            raise LoRAError(f"{what} is not supported")
    if raw.get("bias", "none") != "none":
        raise LoRAError("adapters with trained biases (bias != 'none') are not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAError(f"rank {rank} exceeds max_lora_rank {max_lora_rank}")
    targets = raw.get("target_modules")
    if isinstance(targets, list) and not set(targets) <= set(TARGETS):
        raise LoRAError(f"target modules {sorted(set(targets) - set(TARGETS))} are not supported "
                        f"(supported: {', '.join(TARGETS)})")
    dims = module_dims(cfg)
    seen: dict[tuple[int, str], set[str]] = {}
    for name, shape in shapes.items():
        m = KEY.match(name)
        if m is None:
            raise LoRAError(f"unexpected tensor {name!r}: only lora_A/lora_B of {', '.join(TARGETS)} are supported")
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in dims:
            raise LoRAError(f"module {module!r} is not supported (supported: {', '.join(TARGETS)})")
        if layer >= cfg.num_hidden_layers:
            raise LoRAError(f"{name}: layer {layer} but the base model has {cfg.num_hidden_layers} layers")
        d_in, d_out = dims[module]
        want = [rank, d_in] if which == "A" else [d_out, rank]
        if list(shape) != want:
            raise LoRAError(f"{name} has shape {list(shape)}, the base model needs {want} (rank {rank})")
        seen.setdefault((layer, module), set()).add(which)
    if not seen:
        raise LoRAError("the adapter has no lora_A/lora_B weights")
    half = [f"layers.{layer}.{module}" for (layer, module), ab in seen.items() if ab != {"A", "B"}]
    if half:
        raise LoRAError(f"{half[0]} has only one of lora_A / lora_B")
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterSpec(rank, float(alpha), scale, tuple(m for m in TARGETS if any(k[1] == m for k in seen)),
                       tuple(sorted({k[0] for k in seen})))


def read_adapter(folder: str | Path, pin: bool = False) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's host copy, as stored: (layer, projection) -> (lora_A [rank, in], lora_B [out, rank]).
    It runs on the loader thread, so it only reads the file (no torch compute there: a second thread running
    intra-op parallel kernels slows every small kernel of the engine's thread several times over on CPU, and its
    many small ops would wait on the GIL of a busy engine). Laying it out in a slot is `LoRAManager._fill`'s."""
    from safetensors.torch import load_file
    weights = {}
    for name, t in load_file(str(Path(folder) / "adapter_model.safetensors")).items():
        m = KEY.match(name)
        key = (int(m[1]), m[2])
        a, b = weights.get(key, (None, None))
        weights[key] = (t, b) if m[3] == "A" else (a, t)
    return {k: (a.pin_memory(), b.pin_memory()) if pin else (a, b) for k, (a, b) in weights.items()}


class LoRALinear(nn.Module):
    """A base linear plus the adapters' products of the step's tokens (the base GEMM runs once for all)."""

    def __init__(self, base: nn.Module, weights: tuple[torch.Tensor, torch.Tensor], manager: "LoRAManager",
                 blocks: tuple[int, ...]):
        super().__init__()
        self.base = base
        self.a, self.b = weights       # [slots, in, n*R], [slots, n*R, out]
        self.blocks = blocks if len(blocks) > 1 else None    # output widths of the stacked projections
        self._manager = [manager]      # in a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._manager[0].plan
        if isinstance(self.base, RowParallelLinear):    # the rank's input features: its part of x @ A goes into
            y = self.base.partial(x)                    # the partial sum before the all-reduce
            return self.base.reduce(y if plan is None else sgmv(y, x, self.a, self.b, plan, self.blocks))
        y = self.base(x)
        return y if plan is None else sgmv(y, x, self.a, self.b, plan, self.blocks)


class LoRAManager:
    def __init__(self, model: nn.Module, cfg: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 device: torch.device, dtype: torch.dtype, shard: Shard = Shard()):
        """shard: a tensor-parallel rank's place; its slots hold the slices of each adapter its layers need (B's
        output rows of the column-parallel projections, A's input columns of the row-parallel ones)."""
        self.cfg, self.max_loras, self.max_rank, self.max_cpu = cfg, max_loras, max_lora_rank, max_cpu_loras
        self.slicer = WeightSlicer(cfg, shard)
        self.on_fill = None      # rank 0 of a group: called (slot, name, path) after a fill, for the other ranks
        self.token_slots: list[int] = []     # the last planned step's slot per token (-1: none)
        self.device, self.dtype = torch.device(device), dtype
        self.adapters: dict[str, LoRARequest] = {}
        self.specs: dict[str, AdapterSpec] = {}
        self.pinned: set[str] = set()
        self.host: OrderedDict[str, list] = OrderedDict()       # least recently used first
        self.loading: dict[str, Future] = {}
        self.failed: dict[str, str] = {}
        self.slots: list[str | None] = [None] * max_loras
        self.slot_of: OrderedDict[str, int] = OrderedDict()     # least recently used first
        self.evictions: list[str] = []                          # adapters that lost their slot, in order
        self.host_evictions = 0
        self.loads = 0
        self.load_s = 0.0
        self.tokens: dict[str, int] = {}
        self.plan = None
        self.calibration_slots: list[int] | None = None   # set by calibration: every step plans these token slots
        self.running: list = []     # the scheduler's running sequences (their adapters keep their slots)
        self.waiting: list = []     # and its waiting ones (their adapters keep their host copies)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._lock = threading.RLock()      # add() comes from request threads, the rest from the engine's
        self.weights = []        # per layer: {stack: (a [slots, in, n*R], b [slots, n*R, out])}
        dims = self.dims = self._local_dims()
        for layer in model.layers:
            stacks = {}
            for stack, parts in STACKS.items():
                d_in, d_out = dims[parts[0]][0], sum(dims[p][1] for p in parts)
                n = len(parts) * max_lora_rank
                stacks[stack] = (torch.zeros(max_loras, d_in, n, dtype=dtype, device=self.device),
                                 torch.zeros(max_loras, n, d_out, dtype=dtype, device=self.device))
                owner = layer.self_attn if stack in ("qkv_proj", "o_proj") else layer.mlp
                setattr(owner, stack, LoRALinear(getattr(owner, stack), stacks[stack], self,
                                                 tuple(dims[p][1] for p in parts)))
            self.weights.append(stacks)

    def _local_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection on this rank."""
        dims = {}
        for part, (d_in, d_out) in module_dims(self.cfg).items():
            if part in self.slicer.rows and self.slicer.shard.parallel:
                d_out = len(range(*self.slicer.rows[part]))
            elif part in self.slicer.cols and self.slicer.shard.parallel:
                d_in = len(range(*self.slicer.cols[part]))
            dims[part] = (d_in, d_out)
        return dims

    def _local(self, part: str, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slices of a projection's A [r, in] and B [out, r]."""
        if not self.slicer.shard.parallel:
            return lora_a, lora_b
        if part in self.slicer.rows:
            a, b = self.slicer.rows[part]
            return lora_a, lora_b[a:b]
        a, b = self.slicer.cols[part]
        return lora_a[:, a:b], lora_b

    # -- registration and loading ------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> None:
        """Know an adapter (checked against the base model; LoRAError if it does not fit) and start loading it
        when it is pinned (thread-safe)."""
        with self._lock:
            self._add(lora)

    def _add(self, lora: LoRARequest) -> None:
        known = self.adapters.get(lora.name)
        if known is not None and known.path != lora.path:
            raise LoRAError(f"adapter {lora.name!r} is already loaded from another folder ({known.path})")
        if lora.pinned and lora.name not in self.pinned and len(self.pinned) + 1 >= self.max_loras:
            raise LoRAError(f"pinning {lora.name!r} would leave no slot of max_loras={self.max_loras} to the "
                            "unpinned adapters")
        if known is not None:
            if lora.pinned and lora.name not in self.pinned:
                self._pin(lora.name)
            return
        spec = check_adapter(lora.path, self.cfg, self.max_rank)
        self.specs[lora.name] = spec
        self.adapters[lora.name] = lora
        if lora.pinned:
            self._pin(lora.name)

    def _pin(self, name: str) -> None:
        self.pinned.add(name)
        self._ready(name)         # starts the load

    def _start_load(self, name: str, force: bool = False) -> bool:
        if len(self.host) + len(self.loading) >= self.max_cpu:
            # a host copy no sequence waits for, else one whose adapter sits in a slot; never a pinned one, nor
            # one that waiting sequences still need (evicting those would have loads chase each other forever)
            live = {s.lora for s in self.running} | {s.lora for s in self.waiting}
            victim = next((n for n in self.host if n not in self.pinned and n not in live), None) or \
                next((n for n in self.host if n not in self.pinned and n in self.slot_of), None)
            if victim is None and not force:
                return False
            if victim is not None:
                del self.host[victim]
                self.host_evictions += 1
        lora, spec = self.adapters[name], self.specs[name]
        pin = self.device.type == "cuda"

        def load():
            started = time.perf_counter()
            tensors = read_adapter(lora.path, pin)
            release_team()      # this loader thread lives on: its OpenMP team would throttle the stepping one's
            return tensors, time.perf_counter() - started
        self.loading[name] = self._executor.submit(load)
        return True

    def _poll(self) -> None:
        for name, future in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[name]
            try:
                tensors, seconds = future.result()
            except Exception as e:  # noqa: BLE001 - a broken adapter fails its requests, not the engine
                log.warning("adapter %s failed to load: %s", name, e)
                self.failed[name] = f"adapter {name!r} failed to load: {e}"
                continue
            self.host[name] = tensors
            self.loads += 1
            self.load_s += seconds
            if name in self.pinned and name not in self.slot_of:     # a pinned adapter takes a slot at once
                self._slot(name, self.pinned | {s.lora for s in self.running if s.lora is not None})  # if free

    def ready(self, name: str) -> bool:
        """Whether the adapter can run now (in a slot or on the host); if not, its load is started (or retried
        when a host copy frees)."""
        with self._lock:
            return self._ready(name)

    def _ready(self, name: str) -> bool:
        if name in self.slot_of or name in self.host:
            return True
        self._poll()
        if name in self.host:
            return True
        if name not in self.loading and name not in self.failed:
            self._start_load(name)
        return False

    def wait_loading(self, timeout: float) -> None:
        """Block until a pending load ends or `timeout` seconds pass (a step that found nothing to run calls it, so
        an engine whose requests all wait on adapters does not spin against the loader)."""
        with self._lock:
            pending = list(self.loading.values())
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def take_failed(self) -> dict[str, str]:
        with self._lock:
            return self._take_failed()

    def _take_failed(self) -> dict[str, str]:
        self._poll()
        failed, self.failed = self.failed, {}
        for name in failed:
            self.adapters.pop(name, None)
            self.specs.pop(name, None)
            self.pinned.discard(name)
        return failed

    # -- scheduling ------------------------------------------------------------------------------------
    def admissible(self, lora: str | None, running) -> bool:
        """Whether a sequence of this adapter may join the running ones: its adapter is on hand and the running
        sequences' adapters plus the pinned ones, with it, fit in max_loras slots."""
        if lora is None:
            return True
        with self._lock:
            if not self._ready(lora):
                return False
            adapters = {s.lora for s in running if s.lora is not None}
            if lora in adapters or (lora in self.pinned and lora in self.slot_of):
                return True
            return len(adapters | self.pinned | {lora}) <= self.max_loras

    def begin_step(self, seqs, num_new_tokens) -> bool:
        """Put the step's adapters in slots and plan its per-token products; False when no token has one."""
        if self.calibration_slots is not None:       # the engine's calibration: the slots as they are (zeros)
            self.token_slots = list(self.calibration_slots)
            self.plan = make_plan(self.calibration_slots, self.device, self.dtype)
            return True
        needed = {s.lora for s in seqs if s.lora is not None}
        if not needed:
            self.plan = None
            return False
        with self._lock:
            return self._begin_step(seqs, num_new_tokens, needed)

    def _begin_step(self, seqs, num_new_tokens, needed) -> bool:
        keep = needed | {s.lora for s in self.running if s.lora is not None} | self.pinned
        token_slots = []
        for seq, n in zip(seqs, num_new_tokens):
            slot = -1 if seq.lora is None else self._slot(seq.lora, keep)
            assert slot is not None, "admission leaves a slot for every running adapter"
            token_slots.extend([slot] * n)
            if seq.lora is not None:
                self.tokens[seq.lora] = self.tokens.get(seq.lora, 0) + n
        self.token_slots = token_slots
        self.plan = make_plan(token_slots, self.device, self.dtype)
        return True

    def end_step(self) -> None:
        self.plan = None

    def follow_plan(self, token_slots: list[int]) -> None:
        """A rank > 0: the step's per-token slots as rank 0 planned them."""
        self.plan = make_plan(token_slots, self.device, self.dtype)

    def follow_fill(self, slot: int, name: str, path: str) -> None:
        """A rank > 0: fill `slot` as rank 0 did, reading the adapter (its slices) from its folder."""
        with self._lock:
            if name not in self.adapters:
                self._add(LoRARequest(name, path))
            if name not in self.host:
                self.host[name] = read_adapter(path, self.device.type == "cuda")
                while len(self.host) > self.max_cpu:
                    self.host.popitem(last=False)
            self.host.move_to_end(name)
            self._fill(slot, name)
            if self.slots[slot] is not None:
                self.slot_of.pop(self.slots[slot], None)
            self.slots[slot] = name
            self.slot_of[name] = slot

    def _slot(self, name: str, keep: set[str]) -> int | None:
        """The adapter's slot, loading it there (from the least recently used adapter outside `keep` when no slot
        is free); None when every slot holds one of `keep`."""
        if name in self.slot_of:
            self.slot_of.move_to_end(name)
            return self.slot_of[name]
        if None in self.slots:
            slot = self.slots.index(None)
        else:
            victim = next((n for n in self.slot_of if n not in keep), None)
            if victim is None:
                return None
            slot = self.slot_of.pop(victim)
            self.evictions.append(victim)
        if name not in self.host:              # admitted from a slot it has since lost: read it again, now
            self._poll()
            if name not in self.host:
                if name not in self.loading:
                    self._start_load(name, force=True)
                self.loading[name].result()
                self._poll()
        self.host.move_to_end(name)
        self._fill(slot, name)
        self.slots[slot] = name
        self.slot_of[name] = slot
        if self.on_fill is not None:
            self.on_fill(slot, name, self.adapters[name].path)
        return slot

    def _fill(self, slot: int, name: str) -> None:
        """Lay the adapter's host copy out in the slot: its A's side by side along the rank (one shrink per stacked
        linear), its B's (times the adapter's scale) as the diagonal blocks of the stack's B, zero elsewhere."""
        host, spec, r_max = self.host[name], self.specs[name], self.max_rank
        dims = self.dims
        for layer, stacks in enumerate(self.weights):
            for stack, (a, b) in stacks.items():
                a[slot].zero_()
                b[slot].zero_()
                col = 0
                for i, part in enumerate(STACKS[stack]):
                    width = dims[part][1]
                    if (layer, part) in host:
                        lora_a, lora_b = self._local(part, *host[(layer, part)])
                        a[slot, :, i * r_max:i * r_max + spec.rank].copy_(lora_a.T, non_blocking=True)
                        block = b[slot, i * r_max:i * r_max + spec.rank, col:col + width]
                        block.copy_(lora_b.T, non_blocking=True)
                        block.mul_(spec.scale)
                    col += width

    def stats(self) -> dict:
        with self._lock:
            self._poll()
            return {"resident": len(self.slot_of), "loading": len(self.loading), "host_copies": len(self.host),
                    "evicted": len(self.evictions), "host_evicted": self.host_evictions, "loads": self.loads,
                    "load_s": round(self.load_s, 4), "pinned": sorted(self.pinned), "max_loras": self.max_loras,
                    "tokens": dict(self.tokens), "resident_adapters": list(self.slot_of)}
