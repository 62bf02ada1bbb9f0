"""The engine's optimised CPU paths against the plain torch ones they replace: the fused native ops
(kernels/csrc/fused_cpu.cpp via kernels/layer_ops.py), oneDNN prepacked linear layers (kernels/cpu_linear.py), and
a whole model run both ways."""
import pytest
import torch
from torch import nn

from tidepool.kernels import cpu_ops
from tidepool.kernels.attention import store_kv
from tidepool.kernels.cpu_linear import PackedLinear, prepack_linears
from tidepool.kernels.layer_ops import rms_norm, rms_norm_ref, rotary, rotary_ref, silu_and_mul, silu_and_mul_ref
from tidepool.kernels.paged_attention import store_kv_ref
from tidepool.workers.engine import LLMEngine, SamplingParams
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.models.llama import AttentionContext
from tidepool.workers.tools.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(cpu_ops.compiler() is None, reason="no C++ compiler")
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}     # relative to the largest value: fp32 rounding; one bf16 ulp


@pytest.fixture(autouse=True)
def native_kernels_switched_on(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_enabled", True)
    assert cpu_ops.paged_decode_op() is not None, cpu_ops.unavailable_reason()


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got.float() - want.float()).abs().max().item() <= TOL[dtype] * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_fused_ops_match_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    hidden = 576
    wide = (torch.randn(rows, 3 * hidden, generator=gen) * 3).to(dtype)
    x = wide[:, hidden:2 * hidden]                        # rows strided, as a split of a wider matmul output
    residual, weight = torch.randn(rows, hidden, generator=gen).to(dtype), torch.rand(hidden, generator=gen).to(dtype)
    assert close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), dtype)
    want_residual = residual + x
    out, new_residual = rms_norm(x, weight, 1e-5, residual.clone())
    assert torch.equal(new_residual, want_residual)       # one rounding of the sum, as torch does it
    assert close(out, rms_norm_ref(want_residual, weight, 1e-5), dtype)
    gate_up = wide[:, :2 * hidden] * 4                   # silu well into both tails
    assert close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), dtype)

    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k = qkv[:, :heads * dim].view(rows, heads, dim), qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    angles = torch.rand(rows, dim // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    want_q, want_k = rotary_ref(q, k, cos, sin)
    got_q, got_k = rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()              # in place, inside the qkv output
    assert close(got_q, want_q, dtype) and close(got_k, want_k, dtype)

    caches = [torch.full((32, 16, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(4)]
    slots = torch.randperm(32 * 16, generator=gen)[:rows]
    slots[::2] = -1
    store_kv("torch", k, k * 2, caches[0], caches[1], slots)
    store_kv_ref(k, k * 2, caches[2], caches[3], slots)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("scale", [2.0 ** -8, 3 * 2.0 ** -9, -(2.0 ** -8), 2.0 ** -20, 1.0])
def test_bf16_rounding_matches_torch_bit_for_bit(scale):
    """The kernels' fp32 -> bf16 rounding (AVX-512: the AVX512-BF16 instruction, blocks with a NaN or a denormal on
    exact integer ops; elsewhere c10::BFloat16) through add_rms_norm's residual sum: every bf16 bit pattern plus a
    fraction of itself (ties to even, denormals, overflow to inf), in order and shuffled, against torch's add;
    NaN stored as c10's 0x7FC0."""
    gen = torch.Generator().manual_seed(0)
    base = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    residual = torch.cat([base, base[torch.randperm(base.numel(), generator=gen)]]).view(-1, 512)
    x = residual * scale
    want = residual + x
    got = residual.clone()
    rms_norm(x, torch.ones(512, dtype=torch.bfloat16), 1e-5, got)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert (got.view(torch.int16)[nan] == 0x7FC0).all()


def test_fused_ops_fall_back_when_switched_off(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_enabled", False)
    x = torch.randn(4, 32)
    assert torch.equal(rms_norm(x, torch.ones(32), 1e-6), rms_norm_ref(x, torch.ones(32), 1e-6))
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))
    model = nn.Sequential(nn.Linear(32, 8))
    assert prepack_linears(model) == 0 and type(model[0]) is nn.Linear


def onednn_packs_bf16() -> bool:
    """oneDNN's bf16 weight reorder needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT; elsewhere it refuses."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return False
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear(dtype):
    """Packed where oneDNN can pack the dtype on this CPU; elsewhere the plain layers stay (the self-check's
    fallback). Either way the outputs are F.linear's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 960, bias=True), nn.Linear(960, 49, bias=False)).to(dtype)
    plain = [(m.weight.clone(), None if m.bias is None else m.bias.clone()) for m in model]
    if dtype == torch.bfloat16 and not onednn_packs_bf16():
        assert prepack_linears(model) == 0 and all(type(m) is nn.Linear for m in model)
    else:
        assert prepack_linears(model) == 2 and all(type(m) is PackedLinear for m in model)
    for rows in (1, 5, 64, 700):
        x = torch.randn(rows, 576).to(dtype)
        want = nn.functional.linear(nn.functional.linear(x, *plain[0]), *plain[1])
        assert close(model(x), want, dtype) if dtype == torch.float32 else \
            (model(x).float() - want.float()).abs().max().item() <= 3e-2 * want.float().abs().max().item()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("fused"), seed=1, init_std=0.08, arch="llama",
                               num_attention_heads=4, num_key_value_heads=2))


def prefill_and_decode_logits(model_dir: str, dtype: str) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits of a mixed prefill step, and greedy tokens of a staggered run."""
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, num_kv_blocks=64))
    runner = engine.runner
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.model_config.vocab_size
    lengths = [1, 17, 40]
    ids = torch.randint(3, vocab, (sum(lengths),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])
    tables = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    slots = torch.cat([tables[b].repeat_interleave(16)[:n].long() * 16 + torch.arange(n) % 16
                       for b, n in enumerate(lengths)])
    ctx = AttentionContext(backend=runner.backend, slot_mapping=slots, block_tables=tables,
                           context_lens=torch.tensor(lengths, dtype=torch.int32),
                           cu_seqlens_q=torch.tensor([0, 1, 18, 58], dtype=torch.int32), max_seqlen_q=40)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(ids, positions, ctx)).float()
    prompts = [ids[:n].tolist() for n in (5, 30, 9, 1)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    return logits, [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_optimised_against_plain_torch(tiny_dir, monkeypatch, dtype):
    """The whole model with prepacked linears and fused ops against F.linear and torch ops (TIDEPOOL_CPU_KERNELS=0)."""
    fast_logits, fast_tokens = prefill_and_decode_logits(tiny_dir, dtype)
    monkeypatch.setattr(cpu_ops, "_enabled", False)
    plain_logits, plain_tokens = prefill_and_decode_logits(tiny_dir, dtype)
    scale = plain_logits.abs().max().item()
    err = (fast_logits - plain_logits).abs().max().item()
    assert err <= (1e-5 if dtype == "float32" else 5e-2) * scale, err
    if dtype == "float32":
        assert fast_tokens == plain_tokens


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_reads_the_steps_own_kv_like_the_cache(group):
    """A sequence that is all new attends over the step's K/V rows; one with cached context gathers from the cache."""
    gen = torch.Generator().manual_seed(group)
    kv_heads, dim, block_size = 2, 64, 16
    q_lens, contexts = [30, 1, 7, 16], [30, 9, 20, 16]            # all new, decode, a chunk after context, all new
    tables = torch.randperm(16, generator=gen)[:16].view(4, 4).int()
    caches = [torch.full((16, block_size, kv_heads, dim), float("nan")) for _ in range(2)]
    for b, n in enumerate(contexts):                               # the context before this step's rows
        old = n - q_lens[b]
        slots = tables[b].repeat_interleave(block_size)[:old].long() * block_size + torch.arange(old) % block_size
        store_kv_ref(torch.randn(old, kv_heads, dim, generator=gen), torch.randn(old, kv_heads, dim, generator=gen),
                     *caches, slots)
    key, value = torch.randn(sum(q_lens), kv_heads, dim, generator=gen), torch.randn(sum(q_lens), kv_heads, dim, generator=gen)
    slots = torch.cat([tables[b].repeat_interleave(block_size)[c - n:c].long() * block_size + torch.arange(c - n, c) % block_size
                       for b, (n, c) in enumerate(zip(q_lens, contexts))])
    store_kv_ref(key, value, *caches, slots)
    q = torch.randn(sum(q_lens), kv_heads * group, dim, generator=gen)
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    lens = torch.tensor(contexts, dtype=torch.int32)
    from tidepool.kernels.paged_attention import paged_attention_ref
    from_cache = paged_attention_ref(q, *caches, tables, lens, cu, 0.125)
    from_step = paged_attention_ref(q, *caches, tables, lens, cu, 0.125, key=key, value=value)
    assert torch.isfinite(from_step).all()
    assert (from_step - from_cache).abs().max().item() <= 1e-6
