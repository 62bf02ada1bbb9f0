"""EngineConfig: the engine's knobs. The engine reads no environment variable: the workers build this from the
settings (service/ledger/settings.py via workers/config_fields.py), tests and benchmarks pass fields directly."""
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tidepool.kernels.kv_quant import cache_row_width, storage_dtype
from tidepool.workers.engine.kv_scales import load_calibration, resolve
from tidepool.workers.engine.models.model_config import load_config

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


ONLINE_CLASSES = ("realtime", "interactive")
# Per device type: a CPU step of even a small model takes tens of milliseconds, a GPU step a few.
DEFAULT_SLA_TARGETS = {
    "cuda": {"realtime": {"ttft_ms": 200.0, "itl_ms": 50.0}, "interactive": {"ttft_ms": 1000.0, "itl_ms": 100.0}},
    "cpu": {"realtime": {"ttft_ms": 600.0, "itl_ms": 60.0}, "interactive": {"ttft_ms": 2000.0, "itl_ms": 300.0}},
}


def sla_targets_for(device: str = "cpu", overrides: dict | None = None) -> dict:
    """Targets per online class: DEFAULT_SLA_TARGETS for the device, with `overrides` ({class: {target: ms}}, e.g.
    from the TIDEPOOL_SLA_<CLASS>_<TARGET>_MS settings) laid over them."""
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    targets = {c: dict(t) for c, t in DEFAULT_SLA_TARGETS[kind].items()}
    for cls, values in (overrides or {}).items():
        targets.setdefault(cls, {}).update(values)
    return targets


SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str = "none"             # none | ngram | draft
    num_tokens: int = 4              # most draft tokens per sequence and step (k)
    draft_model: str | None = None   # method draft: a model folder sharing the target's tokenizer
    draft_kv_blocks: int | None = None   # method draft: its own KV pool; None: 4 blocks per max_num_seqs seat
    min_n: int = 1                   # ngram: shortest suffix looked up
    max_n: int = 4                   # ngram: longest suffix looked up
    adaptive: bool = True            # False: every eligible sequence drafts num_tokens (tests, benchmarks)

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not isinstance(self.num_tokens, int) or not 1 <= self.num_tokens <= 32:
            raise ValueError("speculative num_tokens must be an integer in [1, 32]")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("speculative ngram sizes need 1 <= min_n <= max_n")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a model folder)")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig":
        """None, a SpeculativeConfig, a dict of its fields, or text 'method[:num_tokens[:draft_model]]'."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            method, _, rest = value.strip().partition(":")
            num, _, draft = rest.partition(":")
            value = {"method": method or "none"}
            if num:
                if not num.isdigit():
                    raise ValueError(f"speculative num_tokens must be an integer, got {num!r}")
                value["num_tokens"] = int(num)
            if draft:
                value["draft_model"] = draft
        if not isinstance(value, dict):
            raise ValueError("speculative must be a dict such as {'method': 'ngram', 'num_tokens': 4}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative has unknown field {unknown[0]!r}")
        return cls(**value)

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str | None = None                    # None: fp32 on CPU, bf16 (fp16 without bf16 support) on GPU
    block_size: int = 16
    num_kv_blocks: int | None = None            # None: sized from kv_cache_memory_bytes / GPU free memory
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None            # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str | None = None        # "torch" | "triton"; None: by device
    kv_cache_memory_bytes: int | None = None    # CPU default: a quarter of available memory
    gpu_memory_utilization: float = 0.85        # share of free GPU memory given to the KV pool
    kv_share: float = 1.0                       # this engine's part of the host's CPU KV budget when engines of
                                                # one process split it (serve's models, a --models worker's)
    enforce_eager: bool = False                 # True: no CUDA graphs on GPU
    # Online classes' latency targets; None: DEFAULT_SLA_TARGETS for the device (sla_targets_for).
    sla_targets: dict | None = None
    capacity_policy: str = "max_utilization"    # or "no_evict"
    online_reserve: float = 0.1                 # share of blocks and seats only online work may take
    offline_floor: float = 0.5                  # least share of step time offline work gets beside online work
    step_cut: bool = True                       # an online arrival's first-token step may run between two layers
                                                # of the step in flight (LLMEngine._StepCut) instead of after it
    swap_space_gib: float | None = None         # host pool for swapped blocks; None: 4 on CUDA and 0 on CPU (where
                                                # the KV pool already is host memory)
    calibrate: bool = True                      # seed the step cost model with a few timed steps at start
    cpu_kernels: bool | None = None             # native CPU kernels (kernels/cpu_ops.configure); None: as they are
    kernel_cache: str | None = None             # their build folder; None: the user's cache folder
    max_loras: int = 0                          # LoRA adapter slots on the device (workers.engine.lora); 0: no LoRA
    max_lora_rank: int = 16                     # every slot is padded to this rank; a higher-rank adapter is refused
    max_cpu_loras: int | None = None            # host copies of adapters kept; None: 2 x max_loras
    # Speculative decoding (SpeculativeConfig above; workers/engine/spec_decode.py): a dict such as
    # {"method": "ngram", "num_tokens": 4}, or text "ngram:4"; None: off.
    speculative: SpeculativeConfig | dict | str | None = None
    step_trace: str | None = None               # a file each step appends one JSON line to (step_trace.py)
    # Tensor parallelism (workers/engine/tensor_parallel.py): the model sharded over this many ranks, one device
    # each (disjoint cores on a CPU host); rank 0 schedules and samples, the others are child processes.
    tensor_parallel_size: int = 1
    collective_timeout_s: float = 60.0          # a rank that does not join a collective by then fails the group
    device_memory_gib: float | None = None      # each device's memory, capped (simulates a smaller device): a rank's
                                                # weights and KV pool must fit in it; None: the device's own
    # Quantized KV cache (kernels/kv_quant.py, workers/engine/kv_scales.py): "auto" (the model's dtype), "fp8_e4m3",
    # "fp8_e5m2" or "int8"; the pool's block count follows the element size.
    kv_cache_dtype: str = "auto"
    kv_cache_calibration: dict | None = None    # `tidepool models calibrate-kv`'s record (the registry's copy); None:
                                                # the model folder's kv_cache_scales.json, if any

    def __post_init__(self):
        path = Path(self.model)
        if not path.is_dir():
            raise ValueError(f"model folder {self.model!r} does not exist")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 2 * self.max_loras
        elif self.max_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if not 0 < self.kv_share <= 1:
            raise ValueError("kv_share must be in (0, 1]")
        self._resolve_scheduling()
        self._check_tensor_parallel()
        self.speculative = SpeculativeConfig.parse(self.speculative)
        self.model_config = load_config(path)
        if self.kv_cache_calibration is None:
            self.kv_cache_calibration = load_calibration(path)
        self.kv_choice = resolve(self.kv_cache_dtype, self.kv_cache_calibration, path.name)
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            limit = min(limit, self.model_config.sliding_window)   # no sliding-window attention: stay inside it
        shardable = self.model_config.tensor_parallel_sizes()
        if self.tensor_parallel_size not in shardable:
            raise ValueError(f"this model cannot be split over tensor_parallel_size={self.tensor_parallel_size} ranks "
                             f"(its KV-head groups split over {', '.join(map(str, shardable))})")
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model")

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if not self.collective_timeout_s > 0:
            raise ValueError("collective_timeout_s must be > 0")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ValueError("device_memory_gib must be > 0")
        if size == 1:
            return
        if torch.device(self.device).type == "cuda":
            if size > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; this host has "
                                 f"{torch.cuda.device_count()}")
        elif size > len(os.sched_getaffinity(0)):
            raise ValueError(f"tensor_parallel_size {size} needs a CPU core per rank; this process may use "
                             f"{len(os.sched_getaffinity(0))}")

    def _resolve_scheduling(self) -> None:
        if self.sla_targets is None:
            self.sla_targets = sla_targets_for(self.device)
        for cls, targets in self.sla_targets.items():
            if cls not in ONLINE_CLASSES:
                raise ValueError(f"sla_targets apply to {ONLINE_CLASSES}, not {cls!r}")
            for name, value in targets.items():
                if name not in ("ttft_ms", "itl_ms") or not value > 0:
                    raise ValueError(f"sla_targets[{cls!r}]: ttft_ms and itl_ms must be > 0, got {name}={value!r}")
        if self.capacity_policy not in ("max_utilization", "no_evict"):
            raise ValueError(f"capacity_policy must be 'max_utilization' or 'no_evict', got {self.capacity_policy!r}")
        if not 0 <= self.online_reserve < 1:
            raise ValueError("online_reserve must be in [0, 1)")
        if not 0 <= self.offline_floor < 1:
            raise ValueError("offline_floor must be in [0, 1)")
        if self.swap_space_gib is None:
            self.swap_space_gib = 4.0 if torch.device(self.device).type == "cuda" else 0.0
        if self.swap_space_gib < 0:
            raise ValueError("swap_space_gib must be >= 0")

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one KV block takes on one rank's device (keys and values of block_size tokens in every layer, of
        the KV heads that rank holds; a quantized row's own scale included)."""
        m = self.model_config
        dtype = self.kv_storage_dtype
        heads = m.kv_heads_per_rank(self.tensor_parallel_size)
        return 2 * m.num_hidden_layers * self.block_size * heads * cache_row_width(dtype, m.head_dim) * dtype.itemsize

    @property
    def blocks_per_sequence(self) -> int:
        """KV blocks one sequence of max_model_len tokens needs."""
        return -(-self.max_model_len // self.block_size)

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """What the KV pool holds: the model's dtype, or the 8-bit type of the quantized cache in use."""
        return storage_dtype(self.kv_choice.in_use, self.torch_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        if torch.device(self.device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
