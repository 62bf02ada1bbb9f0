"""Embeddings: how a model's hidden states become one vector per input, read from the sentence-transformers files
of its folder (modules.json, 1_Pooling/config.json, sentence_bert_config.json), and the per-request knobs.

Pooling is the same code for an encoder (BERT: all tokens see each other) and a decoder (Llama family: causal;
last-token or mean pooling, as gte-Qwen2 / Qwen3-Embedding do). Without sentence-transformers files: mean pooling
for an encoder, last-token for a decoder, normalised (what TEI and vLLM do by default)."""
import json
from dataclasses import dataclass
from pathlib import Path

import torch

# sentence-transformers' Pooling config keys, in the order its outputs are concatenated
MODES = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
         "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "lasttoken": "pooling_mode_lasttoken"}
ST_MODULES = "sentence_transformers.models."
KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's knobs. truncate: cut inputs longer than the model's max_seq_length (text inputs
    keep their closing special token, as sentence-transformers does) instead of refusing them. dimensions: keep
    the first N dimensions (only for models that declare Matryoshka dimensions), then normalise again."""
    truncate: bool = False
    dimensions: int | None = None

    def __post_init__(self):
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError("dimensions must be a positive integer")


@dataclass(frozen=True)
class PoolingSpec:
    modes: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None
    matryoshka_dimensions: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | Path, encoder: bool) -> "PoolingSpec":
        model_dir = Path(model_dir)
        default_mode = "mean" if encoder else "lasttoken"
        raw = _json(model_dir / "config.json") or {}
        dims = tuple(raw.get("matryoshka_dimensions") or ())
        max_len = (_json(model_dir / "sentence_bert_config.json") or {}).get("max_seq_length")
        modules = _json(model_dir / "modules.json")
        if modules is None:
            return cls((default_mode,), True, max_len, dims)
        kinds = [m.get("type", "").removeprefix(ST_MODULES) for m in modules]
        unknown = [k for k in kinds if k not in KNOWN_MODULES]
        if unknown:
            raise ValueError(f"sentence-transformers module {unknown[0]!r} is not supported "
                             f"(supported: {', '.join(sorted(KNOWN_MODULES))})")
        modes: tuple[str, ...] = (default_mode,)
        pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
        if pooling is not None:
            conf = _json(model_dir / pooling.get("path", "") / "config.json") or {}
            if conf.get("pooling_mode_weightedmean_tokens"):
                raise ValueError("weighted-mean pooling is not supported")
            modes = tuple(m for m, key in MODES.items() if conf.get(key)) or modes
        return cls(modes, "Normalize" in kinds, max_len, dims)


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def pool(hidden: torch.Tensor, spans: list[tuple[int, int]], modes: tuple[str, ...]) -> torch.Tensor:
    """hidden [T, H] of packed inputs; spans: (first row, length) of each input -> [B, H * len(modes)] in fp32."""
    hidden = hidden.float()
    starts = torch.tensor([s for s, _ in spans], device=hidden.device)
    lens = torch.tensor([n for _, n in spans], device=hidden.device)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[starts])
        elif mode == "lasttoken":
            out.append(hidden[starts + lens - 1])
        elif mode == "max":
            out.append(torch.stack([hidden[s:s + n].max(dim=0).values for s, n in spans]))
        else:
            seg = torch.repeat_interleave(torch.arange(len(spans), device=hidden.device), lens)
            rows = torch.cat([torch.arange(s, s + n, device=hidden.device) for s, n in spans])
            sums = torch.zeros(len(spans), hidden.shape[1], device=hidden.device).index_add_(0, seg, hidden[rows])
            out.append(sums / (lens[:, None].float() if mode == "mean" else lens[:, None].float().sqrt()))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def finish(vectors: torch.Tensor, spec: PoolingSpec, params: list[PoolingParams]) -> list[list[float]]:
    """Normalise (when the model does), cut to each request's dimensions (normalising again), as lists."""
    if spec.normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    rows = vectors.tolist()
    for i, p in enumerate(params):
        if p.dimensions is not None and p.dimensions < len(rows[i]):
            cut = vectors[i, :p.dimensions]
            rows[i] = torch.nn.functional.normalize(cut, dim=-1).tolist() if spec.normalize else cut.tolist()
    return rows


def embed_rows(hidden: torch.Tensor, rows: list, spec: PoolingSpec) -> list[tuple]:
    """rows: (sequence, its first row in `hidden`) of inputs computed whole this step -> [(sequence, vector)]."""
    vectors = pool(hidden, [(row, seq.num_tokens) for seq, row in rows], spec.modes)
    return list(zip([seq for seq, _ in rows], finish(vectors, spec, [seq.pooling for seq, _ in rows])))
