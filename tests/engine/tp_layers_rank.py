"""One rank's side of test_tensor_parallel's layer check, importable by a spawned child without the test module's
heavier imports: every sharded layer's output equals the unsharded layer's, exactly (integer-valued fp32)."""
import datetime

import torch
import torch.distributed as dist

from tidepool.workers.engine.models.model_config import ModelConfig
from tidepool.workers.engine.models.sharding import RowParallelLinear, Shard, VocabParallelEmbedding, WeightSlicer
from tidepool.workers.engine.shm_collectives import ShmCollectives
from tidepool.workers.engine.tensor_parallel import Collectives, _process_group


def config(**overrides) -> ModelConfig:
    """6 query heads over 3 KV heads (2 ranks take 2 and 1 KV groups), an odd MLP width and vocabulary."""
    base = dict(model_type="llama", vocab_size=101, hidden_size=24, intermediate_size=37, num_hidden_layers=1,
                num_attention_heads=6, num_key_value_heads=3, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
                rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False,
                mlp_bias=False, sliding_window=None, eos_token_ids=[], torch_dtype=None)
    return ModelConfig(**{**base, **overrides})


def integers(*shape, seed: int) -> torch.Tensor:
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


def check_layers(rank: int, size: int, port: int, shm_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    group = _process_group(store, rank, size, torch.device("cpu"), 30)
    shm = ShmCollectives(rank, size, *ShmCollectives.allocate(size, 1 << 16, shm_path), 30)
    for collectives in (Collectives(rank, size, group, 30, shm), Collectives(rank, size, group, 30, None)):
        check_with(Shard(rank, size, collectives))


@torch.no_grad()
def check_with(shard: Shard) -> None:
    cfg = config()
    slicer = WeightSlicer(cfg, shard)
    x = integers(5, cfg.hidden_size, seed=1)
    for name, (d_out, d_in) in {"layers.0.self_attn.q_proj.weight": (24, 24),
                                "layers.0.mlp.up_proj.weight": (37, 24)}.items():
        w = integers(d_out, d_in, seed=2)
        a, b = slicer.rows[name.split(".")[-2]]
        column = torch.nn.Linear(d_in, b - a, bias=False)
        column.weight.copy_(slicer.take(name, w))
        assert torch.equal(column(x), (x @ w.T)[:, a:b]), name
    for name, (d_out, d_in) in {"layers.0.self_attn.o_proj.weight": (24, 24),
                                "layers.0.mlp.down_proj.weight": (24, 37)}.items():
        w, bias = integers(d_out, d_in, seed=3), integers(d_out, seed=4)
        a, b = slicer.cols[name.split(".")[-2]]
        row = RowParallelLinear(b - a, d_out, True, shard)
        row.linear.weight.copy_(slicer.take(name, w))
        row.bias.copy_(bias)
        x_in = integers(5, d_in, seed=5)
        assert torch.equal(row(x_in[:, a:b]), x_in @ w.T + bias), name
    table = integers(cfg.vocab_size, cfg.hidden_size, seed=6)
    embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
    embed.weight.copy_(slicer.take("model.embed_tokens.weight", table))
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(7))
    assert torch.equal(embed(ids), table[ids])
    logits = shard.comm.gather_rows(x @ embed.weight.T)        # the LM head's rows, tied to the embedding
    if shard.rank == 0:
        assert torch.equal(torch.cat(logits, dim=-1)[:, :cfg.vocab_size], x @ table.T)
    else:
        assert logits is None
