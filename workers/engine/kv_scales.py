"""Which KV cache dtype an engine runs with, and the per-(layer, KV head, channel) scales of a quantized one (each
cache row also takes its own scale when written: kernels/kv_quant.py).

Scales come from the model's calibration (`tidepool models calibrate-kv`: SCALES_FILE in the model folder, a copy in
the registry), which holds every layer's |max| of K and V per (KV head, channel) over the calibration text (per
channel: K's channels differ by an order of magnitude after RoPE, and a channel's scale costs the kernels nothing,
folded into q and the output) and, per dtype, the
accuracy measured on held-out text. The channel scales even out the channels before each row takes its own scale, so
a value past the calibrated |max| is not clipped. Without a calibration the engine takes dynamic scales: the |max| of a
probe forward over PROBE_TEXT at start (as vLLM's on-the-fly scales, but fixed before the first request, so outputs
never depend on which request came first). A dtype whose measured loss (top-1 disagreement or perplexity
increase) exceeds MAX_LOSS is refused: the engine keeps the 16-bit cache (resolve).
"""
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tidepool.kernels.kv_quant import KV_CACHE_DTYPES, scales_from_amax

log = logging.getLogger(__name__)

SCALES_FILE = "kv_cache_scales.json"
MAX_LOSS = 0.02
PROBE_TEXT = (
    "The tide had gone out in the night, and in the grey light of morning the rocks lay bare for a hundred yards. "
    "Pools of still water caught the sky. A heron stood at the edge of the largest one, as patient as a post, while "
    "small crabs moved under the weed. In 1868 the harbour master wrote that the spring tides ran higher than any "
    "he had seen: 'the water came up to the third step of the custom house, and stayed there for an hour.' "
    "Question: how long did the water stay? Answer: about one hour, by his account.\n"
    "def tide_height(t, amplitude=2.5, period=12.42):\n    return amplitude * math.cos(2 * math.pi * t / period)\n"
)


@dataclass
class KVChoice:
    requested: str              # kv_cache_dtype as configured
    in_use: str                 # what the pool holds: requested, or "auto" after a refusal
    calibration: dict | None    # the model's calibration record, if any
    fallback: str | None        # the warning line of a refusal

    @property
    def quantized(self) -> bool:
        return self.in_use != "auto"

    @property
    def measured(self) -> dict | None:
        """The calibration's accuracy figures for the requested dtype, if it measured them."""
        return ((self.calibration or {}).get("accuracy") or {}).get(self.requested)


def load_calibration(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / SCALES_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def save_calibration(model_dir: str | Path, record: dict) -> Path:
    path = Path(model_dir) / SCALES_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


def loss(accuracy: dict) -> float:
    """The guard's figure: the larger of top-1 disagreement and relative perplexity increase."""
    return max(1.0 - accuracy["top1_agreement"], accuracy["ppl_increase"])


def judge(record: dict) -> dict:
    """Mark each dtype's figures in a calibration record with its loss and the guard's verdict (`refused`), which
    the registry shows as they are."""
    for figures in (record.get("accuracy") or {}).values():
        figures["loss"] = loss(figures)
        figures["refused"] = figures["loss"] > MAX_LOSS
    return record


def resolve(kv_cache_dtype: str, calibration: dict | None, model: str = "") -> KVChoice:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    choice = KVChoice(kv_cache_dtype, kv_cache_dtype, calibration, None)
    acc = choice.measured
    if choice.quantized and acc is not None and loss(acc) > MAX_LOSS:
        choice.in_use = "auto"
        choice.fallback = (f"kv_cache_dtype {kv_cache_dtype} refused for {model or 'this model'}: calibration measured "
                           f"top-1 agreement {acc['top1_agreement']:.2%}, perplexity +{acc['ppl_increase']:.2%}, "
                           f"mean KL {acc['mean_kl']:.4f} (more than {MAX_LOSS:.0%} lost): the 16-bit cache serves")
    return choice


class AmaxObserver:
    """Per-(layer, KV head, channel) |max| of the K and V rows a forward stores, by the layers' `observe` hook.
    live=True sets each layer's scales from its running |max| before the layer stores (the start probe on a quantized
    pool)."""

    def __init__(self, layers, dtype: torch.dtype | None = None, live: bool = False):
        self.layers, self.dtype, self.live = layers, dtype, live
        attn = layers[0].self_attn
        self.k_amax = torch.zeros(len(layers), attn.num_kv_heads, attn.head_dim)
        self.v_amax = torch.zeros(len(layers), attn.num_kv_heads, attn.head_dim)

    def __enter__(self):
        for i, layer in enumerate(self.layers):
            layer.self_attn.observe = lambda k, v, i=i: self._see(i, k, v)
        return self

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.self_attn.observe = None

    def _see(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v [T, Hkv, D]
        self.k_amax[i] = torch.maximum(self.k_amax[i], k.detach().abs().amax(dim=0).float().cpu())
        self.v_amax[i] = torch.maximum(self.v_amax[i], v.detach().abs().amax(dim=0).float().cpu())
        if self.live:
            install_layer(self.layers[i].self_attn, self.k_amax[i], self.v_amax[i], self.dtype)


def install_layer(attn, k_amax: torch.Tensor, v_amax: torch.Tensor, dtype: torch.dtype) -> None:
    device = attn.k_cache.device
    attn.k_scale = scales_from_amax(k_amax, dtype).to(device)
    attn.v_scale = scales_from_amax(v_amax, dtype).to(device)


def install(layers, calibration: dict, dtype: torch.dtype, kv_heads: tuple[int, int]) -> None:
    """A calibration's scales into the layers: the KV heads [kv_heads) this rank holds."""
    k_amax, v_amax = torch.tensor(calibration["k_amax"]), torch.tensor(calibration["v_amax"])
    if k_amax.shape[0] != len(layers):
        raise ValueError(f"the KV calibration has {k_amax.shape[0]} layers, the model {len(layers)}")
    a, b = kv_heads
    for i, layer in enumerate(layers):
        install_layer(layer.self_attn, k_amax[i, a:b], v_amax[i, a:b], dtype)
