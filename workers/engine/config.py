import os
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.engine.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


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
    attention_backend: str | None = None        # "torch" | "triton"; None: TIDEPOOL_ATTENTION_BACKEND or by device
    kv_cache_memory_bytes: int | None = None    # CPU default: a quarter of physical memory
    gpu_memory_utilization: float = 0.85        # share of free GPU memory given to the KV pool
    enforce_eager: bool | None = None           # True: no CUDA graphs on GPU; None: TIDEPOOL_ENFORCE_EAGER=1

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
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.enforce_eager is None:
            self.enforce_eager = os.environ.get("TIDEPOOL_ENFORCE_EAGER", "") in ("1", "true", "yes")
        self.model_config = ModelConfig.from_dir(path)
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            limit = min(limit, self.model_config.sliding_window)   # no sliding-window attention: stay inside it
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        if torch.device(self.device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
