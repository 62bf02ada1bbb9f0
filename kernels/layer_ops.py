"""Element-wise ops of the decoder layer: RMSNorm (optionally fused with the residual add), SiLU-and-mul, rotary;
and the greedy sampler's row-wise argmax over the logits.

Each `*_ref` is the torch definition. The dispatchers run the fused native CPU op of kernels/csrc/fused_cpu.cpp
(built with the decode kernel by kernels/cpu_ops.py) for CPU tensors when it is available, else the definition;
the two agree to fp32 rounding (~1e-6 relative), and to the last bit of bf16/fp16 but for reduction order.
argmax_rows agrees with torch.argmax(dim=-1) exactly (first index among equal maxima, the first NaN wins).
"""

import torch

from tidepool.kernels.cpu_ops import CheckedOnce, native_op
from tidepool.kernels.paged_attention import store_kv_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, Hkv, D], cos/sin [T, D] in q's dtype -> rotated (q, k), rotate-half layout."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _fused_op(name: str):
    """torch.ops.tidepool_cpu.<name> once the native library is loaded and its fused ops pass self_check(), else
    None (the definitions above serve)."""
    op = native_op(name)
    return op if op is not None and _fused_checked.ok() else None


def _native(x: torch.Tensor, name: str):
    return _fused_op(name) if x.device.type == "cpu" and x.dim() == 2 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """weight * rms_norm(x); with `residual`: (weight * rms_norm(residual + x), residual + x), where the native op
    adds into `residual` in place."""
    if residual is None:
        op = _native(x, "rms_norm")
        return op(x, weight, eps) if op is not None and x.stride(-1) == 1 else rms_norm_ref(x, weight, eps)
    op = _native(x, "add_rms_norm")
    if op is not None and x.stride(-1) == 1 and residual.stride(-1) == 1:
        return op(x, residual, weight, eps), residual
    residual = residual + x
    return rms_norm_ref(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(x[:, :I]) * x[:, I:]"""
    op = _native(x, "silu_and_mul")
    return op(x) if op is not None and x.stride(-1) == 1 else silu_and_mul_ref(x)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotated (q, k); the native op rotates q and k in place and returns them."""
    op = _fused_op("rotary") if q.device.type == "cpu" else None
    if op is None or q.stride(-1) != 1 or k.stride(-1) != 1:
        return rotary_ref(q, k, cos, sin)
    op(q, k, cos, sin)
    return q, k


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, V] -> int64 [rows], the index of each row's maximum: exactly torch.argmax(dim=-1) (the first
    index among equal maxima; a row's first NaN where it has one). The native op for CPU fp32/bf16/fp16 rows
    (several times faster than torch's on 2 threads), else torch."""
    op = _native(logits, "argmax_rows")
    if op is not None and logits.stride(-1) == 1 and logits.size(-1) > 0 and \
            logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return op(logits)
    return argmax_rows_ref(logits)


def _argmax_cases(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Rows for the argmax check: random, ties, NaNs, -inf, +inf, lengths off the vector width, one long row."""
    x = torch.randn(9, 203, generator=gen).to(dtype)
    x[1, [7, 150]] = 9.0                                   # a tie: the first wins
    x[2, [40, 100]] = float("nan")                         # the first NaN wins
    x[3] = float("-inf")
    x[4, 190:] = float("inf")                              # in the scalar tail
    x[5, :] = 0.0
    x[5, 3] = -0.0
    x[6, 202] = float("nan")
    long = torch.randn(2, 12345, generator=gen).to(dtype)  # split across threads when rows are few
    long[0, [77, 9000]] = 50.0
    long[1, 11000] = float("nan")
    return [x, x[:, :13], x[:1], long, long[:1, :8192], x[:, 1:]]


def self_check() -> None:
    """The native ops against the definitions above on small inputs (fp32 and bf16, odd sizes, strided rows)."""
    ops = torch.ops.tidepool_cpu
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)
        wide = rand(5, 3 * 40)
        x, res, w = wide[:, :40], rand(5, 40), rand(40)
        checks = [(ops.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)),
                  (ops.add_rms_norm(x, res.clone(), w, 1e-5), rms_norm_ref(res + x, w, 1e-5)),
                  (ops.silu_and_mul(wide[:, :80] * 4), silu_and_mul_ref(wide[:, :80] * 4))]
        qkv, cos, sin = rand(5, 5 * 16), rand(5, 16), rand(5, 16)
        q, k = qkv[:, :48].view(5, 3, 16), qkv[:, 48:64].view(5, 1, 16)
        want_q, want_k = rotary_ref(q, k, cos, sin)
        ops.rotary(q, k, cos, sin)
        checks += [(q, want_q), (k, want_k)]
        caches = [torch.zeros(3, 2, 1, 16, dtype=dtype) for _ in range(4)]
        slots = torch.tensor([4, -1, 0, 5, 2])
        ops.store_kv(q[:, :1], k, caches[0], caches[1], slots)
        store_kv_ref(q[:, :1], k, caches[2], caches[3], slots)
        checks += [(caches[0], caches[2]), (caches[1], caches[3])]
        for i, (got, want) in enumerate(checks):
            err = (got.float() - want.float()).abs().max().item()
            if not err <= tol * max(1.0, want.float().abs().max().item()):
                raise RuntimeError(f"self-check: fused op {i} off by {err} in {dtype}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for logits in _argmax_cases(dtype, gen):
            if not torch.equal(ops.argmax_rows(logits), argmax_rows_ref(logits)):
                raise RuntimeError(f"self-check: argmax_rows differs from torch.argmax on {tuple(logits.shape)} {dtype}")


_fused_checked = CheckedOnce(self_check, "native fused CPU ops")
