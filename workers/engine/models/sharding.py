"""Megatron-style tensor parallelism for the Llama family: which slice of every weight a rank holds, and the two layers
that talk to the other ranks.

Column-parallel (each rank computes some output features, no communication): the stacked q/k/v projection (a rank's
KV heads and the query heads that attend to them) and the stacked gate/up projection (a rank's part of the MLP
width); they stay plain nn.Linear layers of the local width. Row-parallel (each rank holds some input features and
the partial products are summed): o_proj and down_proj, one all-reduce each (RowParallelLinear). The embedding and
the LM head are vocabulary-parallel: a rank holds a contiguous block of rows, looks up the ids that fall in it (one
all-reduce fills in the others), and computes its block of the logits, gathered whole on rank 0 for the sampler.

Attention is split by KV-head groups, as evenly as whole groups go (9 query heads over 3 KV heads on 2 ranks: 3 and
6, rank 0 the lighter), so every rank keeps the model's query-per-KV grouping and the kernels need no change; with fewer KV heads than
ranks, each KV head is held by an equal number of ranks that split its query heads."""
from dataclasses import dataclass, field

import torch
from torch import nn

from tidepool.workers.engine.models.model_config import ModelConfig


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    comm: object = field(default=None, compare=False)   # tensor_parallel.Collectives (all_reduce, gather_rows)

    @property
    def parallel(self) -> bool:
        return self.size > 1


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous part of n items: the last n % size ranks take one more (rank 0 also
    schedules and samples, so it gets the lighter part)."""
    base, extra = divmod(n, size)
    light = size - extra                     # ranks with `base` items
    start = rank * base + max(0, rank - light)
    return start, start + base + (rank >= light)


@dataclass(frozen=True)
class HeadSplit:
    q: tuple[int, int]       # [start, stop) of the query heads this rank holds
    kv: tuple[int, int]      # and of the KV heads they attend to

    @property
    def num_heads(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv[1] - self.kv[0]


def head_split(cfg: ModelConfig, shard: Shard) -> HeadSplit:
    kv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    if shard.size <= kv:
        a, b = split(kv, shard.size, shard.rank)
        return HeadSplit((a * group, b * group), (a, b))
    per_head = shard.size // kv                      # ranks sharing one KV head
    head, part = divmod(shard.rank, per_head)
    q0 = head * group + part * (group // per_head)
    return HeadSplit((q0, q0 + group // per_head), (head, head + 1))


def vocab_rows(vocab_size: int, shard: Shard) -> tuple[int, int]:
    """[start, stop) of the vocabulary rows this rank holds; every rank holds ceil(V / size) rows, the last ones
    past V zero (their logits are dropped when gathered)."""
    rows = -(-vocab_size // shard.size)
    return shard.rank * rows, (shard.rank + 1) * rows


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the rank's input features of a linear whose partial products sum to
    the whole. `linear` (no bias) is a plain nn.Linear, so the CPU prepacking swaps it like any other."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.shard = shard

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        self.shard.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows of the embedding; ids outside them look up zeros, and one all-reduce sums the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard):
        self.start, self.stop = vocab_rows(vocab_size, shard)
        super().__init__(self.stop - self.start, hidden_size)
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        x = super().forward((ids - self.start).masked_fill(outside, 0))
        x.masked_fill_(outside[:, None], 0.0)
        self.shard.comm.all_reduce(x)
        return x


def row_parallel(in_features: int, out_features: int, bias: bool, shard: Shard) -> nn.Module:
    return RowParallelLinear(in_features, out_features, bias, shard) if shard.parallel else \
        nn.Linear(in_features, out_features, bias=bias)


def embedding(vocab_size: int, hidden_size: int, shard: Shard) -> nn.Embedding:
    return VocabParallelEmbedding(vocab_size, hidden_size, shard) if shard.parallel else \
        nn.Embedding(vocab_size, hidden_size)


class WeightSlicer:
    """Which part of each checkpoint tensor (Hugging Face names) this rank loads, read straight from the file's
    slice (safetensors get_slice), so no rank ever holds a whole sharded weight."""

    def __init__(self, cfg: ModelConfig, shard: Shard):
        self.cfg, self.shard = cfg, shard
        heads = head_split(cfg, shard)
        d = cfg.head_dim
        self.rows = {"q_proj": (heads.q[0] * d, heads.q[1] * d), "k_proj": (heads.kv[0] * d, heads.kv[1] * d),
                     "v_proj": (heads.kv[0] * d, heads.kv[1] * d)}
        self.rows["gate_proj"] = self.rows["up_proj"] = split(cfg.intermediate_size, shard.size, shard.rank)
        self.cols = {"o_proj": self.rows["q_proj"], "down_proj": self.rows["up_proj"]}
        self.vocab = vocab_rows(cfg.vocab_size, shard)

    def take(self, name: str, tensor_slice) -> torch.Tensor:
        """name: the checkpoint name; tensor_slice: a safetensors slice (or a tensor)."""
        if not self.shard.parallel:
            return tensor_slice[:]
        module, kind = name.split(".")[-2:]
        if module in self.rows:
            a, b = self.rows[module]
            return tensor_slice[a:b]
        if module in self.cols:
            if kind == "bias":                  # added once, after the all-reduce
                return tensor_slice[:]
            a, b = self.cols[module]
            return tensor_slice[:, a:b]
        if module in ("embed_tokens", "lm_head"):
            a, b = self.vocab
            rows = tensor_slice[a:min(b, self.cfg.vocab_size)]
            if rows.shape[0] < b - a:
                rows = torch.cat([rows, rows.new_zeros(b - a - rows.shape[0], *rows.shape[1:])])
            return rows
        return tensor_slice[:]


def largest_rank_weight_bytes(cfg: ModelConfig, size: int, element_size: int) -> int:
    """Bytes of weights the largest of `size` ranks holds (its heads' projections, its part of the MLP and of the
    vocabulary-parallel embedding and LM head rows, the norms)."""
    return max(rank_weight_count(cfg, size, rank) for rank in range(size)) * element_size


def rank_weight_count(cfg: ModelConfig, size: int, rank: int) -> int:
    """Parameters rank `rank` of `size` holds (tied embeddings once)."""
    shard = Shard(rank, size)
    heads, h, d = head_split(cfg, shard), cfg.hidden_size, cfg.head_dim
    q, kv = heads.num_heads * d, heads.num_kv_heads * d
    a, b = split(cfg.intermediate_size, size, rank)
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * (b - a) + 2 * h
    if cfg.attention_bias:
        per_layer += q + 2 * kv
    start, stop = vocab_rows(cfg.vocab_size, shard)
    vocab = (stop - start) * h
    return cfg.num_hidden_layers * per_layer + h + vocab * (1 if cfg.tie_word_embeddings else 2)
