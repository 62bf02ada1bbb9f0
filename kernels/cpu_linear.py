"""CPU linear layers on oneDNN with weights reordered once at load ("prepacked"), as vLLM-CPU and Inductor do.

On CPU, F.linear runs fp32 through MKL's sgemm (slow on AVX-512 AMD CPUs) and reorders a bf16 weight on every
call; oneDNN with a prepacked weight is faster in fp32 and skips the per-call reorder in bf16. `prepack_linears(model)`
swaps every nn.Linear of a CPU model for a PackedLinear (the original weight is dropped unless another module
shares it, e.g. tied embeddings). `fuse_activation(layer, name)` lets a packed layer apply GELU or ReLU to its
output inside the matmul (oneDNN's post-op: one pass over the output fewer). Nothing is swapped, and F.linear stays, when TIDEPOOL_CPU_KERNELS is off, oneDNN
is missing, or a packed layer disagrees with F.linear on a self-check (a warning says why).
"""
import logging

import torch
from torch import nn

from tidepool.kernels.cpu_ops import enabled

log = logging.getLogger(__name__)

BATCH_HINT = 64     # the M oneDNN is told to expect; any M works
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}   # -> (attr, algorithm)
SELF_CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-3}


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.activation = None
        self._post_op = ("none", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attr, algorithm = self._post_op
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, attr, [], algorithm)

    def extra_repr(self) -> str:
        fused = f", then {self.activation}" if self.activation else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked{fused}"


def fuse_activation(layer: nn.Module, activation: str) -> bool:
    """Make a PackedLinear apply `activation` (a POST_OPS name) to its output; False (nothing changed) for any
    other layer or activation, and when the fused output disagrees with the separate one on a self-check."""
    if type(layer) is not PackedLinear or activation not in POST_OPS or layer.activation is not None:
        return False
    x = torch.randn(7, layer.in_features, generator=torch.Generator().manual_seed(0)).to(layer.dtype)
    with torch.no_grad():
        want = {"gelu": nn.functional.gelu, "relu": nn.functional.relu,
                "gelu_tanh": lambda t: nn.functional.gelu(t, approximate="tanh")}[activation](layer(x)).float()
        layer._post_op = POST_OPS[activation]
        err = (layer(x).float() - want).abs().max().item()
    if not err <= SELF_CHECK_TOL[layer.dtype] * max(1.0, want.abs().max().item()):
        layer._post_op = ("none", "")
        log.warning("oneDNN %s post-op off: max abs err %s against the separate activation", activation, err)
        return False
    layer.activation = activation
    return True


def _check(packed: PackedLinear, linear: nn.Linear) -> None:
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 7, 64):
        x = torch.randn(rows, linear.in_features, generator=gen).to(linear.weight.dtype)
        want = nn.functional.linear(x, linear.weight, linear.bias).float()
        err = (packed(x).float() - want).abs().max().item()
        if not err <= SELF_CHECK_TOL[linear.weight.dtype] * max(1.0, want.abs().max().item()):
            raise RuntimeError(f"self-check: max abs err {err} against F.linear ({rows} rows)")


def prepack_linears(model: nn.Module) -> int:
    """Swap the nn.Linear layers of a CPU model for PackedLinear ones; returns how many were swapped."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears or not enabled() or linears[0][1].weight.device.type != "cpu":
        return 0
    if not torch.backends.mkldnn.is_available() or linears[0][1].weight.dtype not in SELF_CHECK_TOL:
        return 0
    swapped = {}
    try:
        for name, linear in linears:
            swapped[name] = PackedLinear(linear)
        _check(swapped[linears[0][0]], linears[0][1])
    except Exception as e:  # noqa: BLE001 - any failure keeps F.linear
        log.warning("oneDNN prepacked linear unavailable, using F.linear: %s: %s", type(e).__name__, e)
        return 0
    for name, packed in swapped.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, packed)
    return len(swapped)
