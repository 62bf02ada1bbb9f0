"""BERT-family encoder (BertModel: absolute positions, token types, GELU, post-LayerNorm) over a packed batch of
variable-length inputs: the linear layers see only real tokens (no padding); attention is bidirectional within
each input and masked between inputs. No KV cache: an input is computed whole in one step.

Weights keep Hugging Face names (a `bert.` prefix is dropped) except that query/key/value are stacked into one
matmul (`qkv`), its query rows scaled by 1/sqrt(head_dim) at load; the pooler is not used (sentence-transformers pools the last hidden states itself)."""
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
POST_OP_NAMES = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    torch_dtype: str | None
    model_type: str = "bert"
    sliding_window: None = None
    eos_token_ids: list[int] = field(default_factory=list)
    is_encoder: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    def tensor_parallel_sizes(self) -> tuple[int, ...]:
        return (1,)      # an encoder small enough to embed with is never split

    def kv_heads_per_rank(self, size: int) -> int:
        return self.num_key_value_heads

    @classmethod
    def from_raw(cls, raw: dict) -> "BertConfig":
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported for BERT models")
        if raw.get("hidden_act", "gelu") not in ACTIVATIONS:
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (supported: {sorted(ACTIVATIONS)})")
        return cls(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
                   num_attention_heads=raw["num_attention_heads"],
                   max_position_embeddings=raw.get("max_position_embeddings", 512),
                   type_vocab_size=raw.get("type_vocab_size", 2), layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
                   hidden_act=raw.get("hidden_act", "gelu"), torch_dtype=raw.get("dtype") or raw.get("torch_dtype"))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "BertConfig":
        return cls.from_raw(json.loads((Path(model_dir) / "config.json").read_text()))


class AttentionPlan:
    """Per step: where each input's rows lie in the packed batch [T]. Attention runs per input on its own rows,
    with no padding and no mask: two batched matmuls over the heads and a softmax. On CPU this beats padded,
    masked SDPA over groups of similar length, as the padding and the mask cost more than a loop over the
    inputs."""

    def __init__(self, lens: list[int]):
        self.spans = []
        start = 0
        for n in lens:
            self.spans.append((start, n))
            start += n

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, 3, H, D], queries already scaled -> attention output [T, H, D]."""
        out = qkv.new_empty(qkv.shape[0], *qkv.shape[2:])
        for start, n in self.spans:
            q, k, v = qkv[start:start + n].permute(1, 2, 0, 3).unbind(0)                # [H, n, D] each
            scores = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)                     # [H, n, n]
            out[start:start + n] = torch.bmm(scores, v).transpose(0, 1)
        return out


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.attn_out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.out_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        qkv = self.qkv(x).view(-1, 3, self.heads, self.head_dim)                # [T, 3, H, D]
        a = plan.attend(qkv).reshape(x.shape)
        x = self.attn_norm(self.attn_out(a) + x)
        return self.out_norm(self.output(self.act(self.intermediate(x))) + x)


class BertModel(nn.Module):
    STACKED = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}
    RENAMED = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
               "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "out_norm"}

    def __init__(self, cfg: BertConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """input_ids, positions [T] of packed inputs (token type 0) -> last hidden states [T, hidden]."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, plan)
        return x

    def _target(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint name -> (parameter name, stacked shard or None); None for weights not used."""
        name = name.removeprefix("bert.")
        if name.startswith("pooler.") or name.endswith("position_ids") or name.startswith("cls."):
            return None
        if name.startswith("embeddings."):
            name = name.removeprefix("embeddings.")
            return ("embed_norm." + name.split(".")[-1] if name.startswith("LayerNorm") else name), None
        if not name.startswith("encoder.layer."):
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        index, rest = name.removeprefix("encoder.layer.").split(".", 1)
        module, leaf = rest.rsplit(".", 1)
        if module in self.STACKED:
            return f"layers.{index}.qkv.{leaf}", self.STACKED[module]
        if module not in self.RENAMED:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        return f"layers.{index}.{self.RENAMED[module]}.{leaf}", None

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        size = self.cfg.hidden_size
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                continue
            pname, shard = target
            if shard is None:
                params[pname].copy_(tensor)
            else:
                params[pname][shard * size:(shard + 1) * size].copy_(tensor)
            loaded.add(pname if shard is None else f"{pname}#{shard}")
        expected = {f"{n}#{i}" for n in params if ".qkv." in n for i in range(3)} | \
            {n for n in params if ".qkv." not in n}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        scale = 1.0 / math.sqrt(self.cfg.head_dim)       # attention's score scale, folded into the queries
        for layer in self.layers:
            layer.qkv.weight[:size] *= scale
            layer.qkv.bias[:size] *= scale
