"""Reading a Hugging Face config.json for the Llama family (Llama 2/3, Mistral, Qwen2)."""
import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = ("llama", "mistral", "qwen2")    # and "bert" (models/bert.py, an encoder)


def load_config(model_dir: str | Path):
    """The model's config: BertConfig for an encoder (model_type bert), else ModelConfig (Llama family)."""
    path = Path(model_dir) / "config.json"
    if path.is_file() and json.loads(path.read_text()).get("model_type") == "bert":
        from tidepool.workers.engine.models.bert import BertConfig
        return BertConfig.from_dir(model_dir)
    return ModelConfig.from_dir(model_dir)


@dataclass
class ModelConfig:
    is_encoder = False          # (not a field) BertConfig's is True
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None

    def tensor_parallel_sizes(self, most: int = 64) -> tuple[int, ...]:
        """The tensor-parallel sizes this model splits over: ranks take whole KV-head groups (as evenly as whole
        groups allow), or, with fewer KV heads than ranks, each KV head is held by an equal number of ranks that
        split its group's query heads."""
        kv, group = self.num_key_value_heads, self.num_attention_heads // self.num_key_value_heads
        return tuple(n for n in range(1, most + 1)
                     if n <= kv or (n % kv == 0 and group % (n // kv) == 0))

    def kv_heads_per_rank(self, size: int) -> int:
        """The most KV heads one rank holds at tensor-parallel `size` (models/sharding.py head_split)."""
        return -(-self.num_key_value_heads // size)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model folder needs config.json")
        raw = json.loads(path.read_text())
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        heads = raw["num_attention_heads"]
        eos = _eos_ids(model_dir, raw)
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            mlp_bias=raw.get("mlp_bias", False),
            sliding_window=sliding,
            eos_token_ids=eos,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _eos_ids(model_dir: Path, raw: dict) -> list[int]:
    generation = model_dir / "generation_config.json"
    ids = _as_list(json.loads(generation.read_text()).get("eos_token_id")) if generation.is_file() else []
    return ids or _as_list(raw.get("eos_token_id"))
