"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flattened, variable-length token batch.

Weights keep Hugging Face names except that q/k/v and gate/up projections are stacked into one
matmul each (`qkv_proj`, `gate_up_proj`); `load_weights` maps the checkpoint onto them.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from tidepool.kernels.attention import paged_attention, store_kv
from tidepool.kernels.layer_ops import rms_norm, rotary, silu_and_mul
from tidepool.workers.engine.models.model_config import ModelConfig
from tidepool.workers.engine.models.sharding import Shard, WeightSlicer, embedding, head_split, row_parallel


@dataclass
class AttentionContext:
    backend: str
    slot_mapping: torch.Tensor      # [T] cache slot of every new token
    block_tables: torch.Tensor      # [B, max_blocks]
    context_lens: torch.Tensor      # [B] tokens in cache per sequence, this step's included
    cu_seqlens_q: torch.Tensor      # [B + 1]
    max_seqlen_q: int


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(residual + x), residual + x)."""
        return rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        self.register_buffer("cos", torch.empty(max_positions, cfg.head_dim), persistent=False)   # [P, D]
        self.register_buffer("sin", torch.empty(max_positions, cfg.head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.build()

    def build(self) -> None:
        """(Re)compute the fp32 cos/sin tables on the buffers' device."""
        device = self.cos.device
        inv_freq = rope_inv_freq(self.cfg).to(device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for a step's positions, looked up once and shared by every layer."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    @staticmethod
    def apply(rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        return rotary(q, k, *rope)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        heads = head_split(cfg, shard)       # this rank's heads (all of them unsharded)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = row_parallel(self.q_size, cfg.hidden_size, cfg.attention_bias and cfg.model_type != "qwen2", shard)
        self.scale = self.head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = None     # [Hkv] fp32 each for a quantized cache (kernels/kv_quant.py)
        self.observe = None                     # observe(k, v) before each store: KV scale calibration (kv_scales.py)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)                     # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)                  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(rope, q, k)
        if self.observe is not None:
            self.observe(k, v)
        store_kv(ctx.backend, k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        out = paged_attention(ctx.backend, q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens,
                              ctx.cu_seqlens_q, ctx.max_seqlen_q, self.scale, key=k, value=v,
                              k_scale=self.k_scale, v_scale=self.v_scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.width = len(range(*WeightSlicer(cfg, shard).rows["up_proj"]))    # this rank's part of the MLP
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.width, bias=cfg.mlp_bias)
        self.down_proj = row_parallel(self.width, cfg.hidden_size, cfg.mlp_bias, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.self_attn = Attention(cfg, shard)
        self.mlp = MLP(cfg, shard)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, ctx):
        """(this layer's MLP output, the residual stream before it is added); residual None in the first layer."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, ctx), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (stacked parameter, shard index)
    STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, max_positions: int, shard: Shard = Shard()):
        super().__init__()
        self.cfg, self.shard = cfg, shard
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, shard)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, self.embed_tokens.num_embeddings, bias=False)   # the rank's rows
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                between_layers=None) -> torch.Tensor:
        """between_layers(i): called before layer i > 0 (the engine's step cut may run a whole other step there: this
        forward's state is its own locals, and the other step's sequences write other cache slots)."""
        x = self.embed_tokens(input_ids)                                  # [T, hidden]
        rope = self.rotary(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            if i and between_layers is not None:
                between_layers(i)
            x, residual = layer(x, residual, rope, ctx)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [S, V] of the hidden rows; with tensor parallelism every rank computes its vocabulary rows and
        rank 0 gets them all (the others None)."""
        logits = self.lm_head(hidden)
        if not self.shard.parallel:
            return logits
        parts = self.shard.comm.gather_rows(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :self.cfg.vocab_size]

    def _shard_offsets(self, stacked: str) -> list[int]:
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp.width
        sizes = [attn.q_size, attn.kv_size, attn.kv_size] if stacked == "qkv_proj" else [mlp, mlp]
        return [sum(sizes[:i]) for i in range(len(sizes) + 1)]

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """weights: iterable of (checkpoint name, tensor or safetensors slice) in Hugging Face naming; a tensor-parallel
        rank reads only its slice of each (sharding.WeightSlicer)."""
        params = {name.replace(".linear.weight", ".weight"): p
                  for name, p in self.named_parameters(remove_duplicate=False)}
        slicer = WeightSlicer(self.cfg, self.shard)
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            tensor = slicer.take(name, tensor)
            for fragment, (stacked, shard) in self.STACKED.items():
                if f".{fragment}." in name:
                    target = name.replace(fragment, stacked)
                    offsets = self._shard_offsets(stacked)
                    params[target][offsets[shard]:offsets[shard + 1]].copy_(tensor)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                params[name].copy_(tensor)
                loaded.add(name)
        expected = set()
        for name in params:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            stacked = name.split(".")[-2]
            if stacked in ("qkv_proj", "gate_up_proj"):
                expected.update(f"{name}#{i}" for i in range(3 if stacked == "qkv_proj" else 2))
            else:
                expected.add(name)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:3]}")
