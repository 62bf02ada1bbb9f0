"""KV cache calibration: per-(layer, KV head) |max| of K and V over calibration text, and the accuracy each quantized
dtype keeps with those scales on held-out text (the record kv_scales.py reads; `tidepool models calibrate-kv`).

Accuracy is teacher-forced: the held-out sequences run in chunks of CHUNK tokens, so every position attends to keys
and values read back from the cache (as decode does), once over the 16-bit cache and once over each quantized one.
Per position: top-1 agreement of the next-token argmax, KL(16-bit || quantized) of the next-token distribution, and
the next token's log-likelihood (perplexity, both caches). Where the argmax differs, the margin the reference's own top
two had (in nats): a small model's next-token choices are often near ties, which any rounding flips (a bf16 cache
under fp32 weights does too: name "bfloat16" among the dtypes measures it, for the figures only).
"""
import time
from contextlib import contextmanager

import torch

from tidepool.kernels.kv_quant import STORAGE, cache_row_width
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.kv_scales import AmaxObserver, install
from tidepool.workers.engine.model_runner import ModelRunner
from tidepool.workers.engine.models.sharding import Shard, head_split

CHUNK = 16          # paged_attention_ref's SHORT_CHUNK: rows attended from the cache, as decode rows
BATCH_TOKENS = 4096


def _batches(seqs: list[list[int]], budget: int = BATCH_TOKENS):
    batch, tokens = [], 0
    for s in seqs:
        if batch and tokens + len(s) > budget:
            yield batch
            batch, tokens = [], 0
        batch.append(s)
        tokens += len(s)
    if batch:
        yield batch


def _step(seqs: list[list[int]], block_size: int, start: int, end: int) -> tuple[dict, list[int]]:
    """One forward over positions [start, end) of every sequence long enough (sequence i in blocks of its own)."""
    step = dict(input_ids=[], positions=[], slot_mapping=[], context_lens=[], cu_seqlens_q=[0], block_tables=[])
    members, first = [], 0
    for i, s in enumerate(seqs):
        width = -(-len(s) // block_size)
        table = list(range(first, first + width))
        first += width
        hi = min(end, len(s))
        if hi <= start:
            continue
        members.append(i)
        step["input_ids"] += s[start:hi]
        step["positions"] += range(start, hi)
        step["slot_mapping"] += [table[p // block_size] * block_size + p % block_size for p in range(start, hi)]
        step["context_lens"].append(hi)
        step["cu_seqlens_q"].append(step["cu_seqlens_q"][-1] + hi - start)
        step["block_tables"].append(table)
    return step, members


@contextmanager
def _cache(layers, caches):
    """The layers attend over `caches` ([(k, v, k_scale, v_scale)] per layer) for the block."""
    saved = [(a.k_cache, a.v_cache, a.k_scale, a.v_scale) for a in (layer.self_attn for layer in layers)]
    for layer, c in zip(layers, caches):
        a = layer.self_attn
        a.k_cache, a.v_cache, a.k_scale, a.v_scale = c
    try:
        yield
    finally:
        for layer, c in zip(layers, saved):
            a = layer.self_attn
            a.k_cache, a.v_cache, a.k_scale, a.v_scale = c


class Calibrator:
    def __init__(self, model: str, dtype: str | None = None, max_len: int = 512):
        bs = 16
        self.config = EngineConfig(model=model, dtype=dtype, num_kv_blocks=2 * BATCH_TOKENS // bs, block_size=bs,
                                   calibrate=False, max_model_len=None, kv_cache_dtype="auto")
        self.runner = ModelRunner(self.config, self.config.model_config)
        self.layers = self.runner.model.layers
        self.max_len = max_len

    def amax(self, samples: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (layer, KV head) |max| of K and V over the samples (prefilled whole, in batches)."""
        with AmaxObserver(self.layers) as seen, torch.inference_mode():
            for batch in _batches([s[:self.max_len] for s in samples]):
                longest = max(map(len, batch))
                step, _ = _step(batch, self.config.block_size, 0, longest)
                self.runner._forward(step, longest, None)
        return seen.k_amax, seen.v_amax

    def _quantized_caches(self, dtype: torch.dtype, record: dict) -> list:
        *shape, head_dim = self.layers[0].self_attn.k_cache.shape
        shape = (*shape, cache_row_width(dtype, head_dim))
        install(self.layers, record, dtype, head_split(self.config.model_config, Shard()).kv)
        out = [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype), a.k_scale, a.v_scale)
               for a in (layer.self_attn for layer in self.layers)]
        for layer in self.layers:
            layer.self_attn.k_scale = layer.self_attn.v_scale = None
        return out

    def _plain_caches(self, dtype: torch.dtype) -> list:
        shape = self.layers[0].self_attn.k_cache.shape
        return [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype), None, None) for _ in self.layers]

    @torch.inference_mode()
    def accuracy(self, heldout: list[list[int]], record: dict, dtypes: list[str]) -> dict:
        """{dtype: {top1_agreement, mean_kl, ppl, ppl_ref, ppl_increase, positions, flip_margins}} over the held-out
        sequences; dtypes: kv_cache_dtypes, or a 16-bit torch dtype name (a plain cache of that type)."""
        quant = {name: self._quantized_caches(STORAGE[name], record) if name in STORAGE
                 else self._plain_caches(getattr(torch, name)) for name in dtypes}
        stats = {name: {"agree": 0, "kl": 0.0, "nll": 0.0, "margins": []} for name in dtypes}
        nll_ref, positions = 0.0, 0
        for batch in _batches([s[:self.max_len] for s in heldout]):
            for start in range(0, max(map(len, batch)) - 1, CHUNK):
                step, members = _step(batch, self.config.block_size, start, start + CHUNK)
                rows, targets = [], []      # rows whose next token is known
                for j, i in enumerate(members):
                    for p in range(start, min(start + CHUNK, len(batch[i]) - 1)):
                        rows.append(step["cu_seqlens_q"][j] + p - start)
                        targets.append(batch[i][p + 1])
                rows_t, targets_t = torch.tensor(rows), torch.tensor(targets)

                def logprobs():
                    hidden = self.runner._forward(step, CHUNK, None)
                    return torch.log_softmax(self.runner.model.compute_logits(hidden[rows_t]).float(), -1)
                ref = logprobs()
                top2 = ref.topk(2, -1).values
                nll_ref -= ref.gather(1, targets_t[:, None]).sum().item()
                positions += len(rows)
                for name, caches in quant.items():
                    with _cache(self.layers, caches):
                        got = logprobs()
                    s = stats[name]
                    same = got.argmax(-1) == ref.argmax(-1)
                    s["agree"] += same.sum().item()
                    s["margins"] += (top2[:, 0] - top2[:, 1])[~same].tolist()
                    s["kl"] += (ref.exp() * (ref - got)).sum().item()
                    s["nll"] -= got.gather(1, targets_t[:, None]).sum().item()
        ppl_ref = float(torch.tensor(nll_ref / positions).exp())
        out = {}
        for name, s in stats.items():
            ppl = float(torch.tensor(s["nll"] / positions).exp())
            out[name] = {"top1_agreement": s["agree"] / positions, "mean_kl": s["kl"] / positions, "ppl": ppl,
                         "ppl_ref": ppl_ref, "ppl_increase": max(0.0, ppl / ppl_ref - 1.0), "positions": positions,
                         "flip_margins": sorted(round(m, 4) for m in s["margins"])}
        return out


def calibrate(model: str, samples: list[list[int]], heldout: list[list[int]], dtype: str | None = None,
              dtypes: tuple[str, ...] = tuple(STORAGE)) -> dict:
    """The calibration record of a model folder (kv_scales.SCALES_FILE's contents)."""
    started = time.perf_counter()
    cal = Calibrator(model, dtype)
    k_amax, v_amax = cal.amax(samples)
    record = {"version": 1, "model_dtype": str(cal.runner.dtype).removeprefix("torch."), "samples": len(samples),
              "tokens": sum(min(len(s), cal.max_len) for s in samples), "k_amax": k_amax.tolist(),
              "v_amax": v_amax.tolist()}
    record["accuracy"] = cal.accuracy(heldout, record, list(dtypes))
    record["heldout_tokens"] = sum(min(len(s), cal.max_len) for s in heldout)
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record
