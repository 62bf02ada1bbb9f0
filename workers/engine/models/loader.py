"""Build a model from a Hugging Face folder: config.json + model.safetensors (or a sharded index)."""
import json
from pathlib import Path

import torch
from safetensors import safe_open

from tidepool.workers.engine.models.model_config import ModelConfig
from tidepool.workers.engine.models.llama import LlamaForCausalLM
from tidepool.workers.engine.models.sharding import Shard


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iter_weights(files: list[Path]):
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_weight_slices(files: list[Path]):
    """(name, slice) of every tensor: indexing a slice reads only that part of the file."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, shard: Shard = Shard()) -> LlamaForCausalLM:
    """The model, or with a tensor-parallel `shard` this rank's part of it (read from the files slice by slice)."""
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, shard)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(iter_weight_slices(safetensors_files(model_dir)))
    model.to(dtype)
    model.rotary.to(torch.float32)
    model.rotary.build()
    return model.eval()
