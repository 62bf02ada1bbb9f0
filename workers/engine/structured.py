"""Constrained decoding: grammars compiled once per schema (xgrammar), a matcher per sequence that
advances with each accepted token, and one token bitmask per step for every constrained row.

A matcher's state is a function of the sequence's output tokens only, so preemption (suspend, swap or
recompute) never touches it; `matcher(spec, tokens)` rebuilds one from tokens when needed.
"""
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from workers.engine.sampling_params import StructuredOutput

MAX_CACHED_GRAMMARS = 512


class Grammar:
    """One sequence's place in its grammar."""
    __slots__ = ("matcher", "json")

    def __init__(self, matcher, json: bool):
        self.matcher = matcher
        self.json = json

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredDecoding:
    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int], device: torch.device):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.device = device
        self._xgr = None
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()          # add_request threads compile while the engine thread steps
        self._bitmask: torch.Tensor | None = None
        self.mask_s = 0.0                      # time spent filling and applying masks
        self.masked_rows = 0

    def _init(self):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                       stop_token_ids=self.stop_token_ids or None)
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        # Compact JSON never holds a raw control character (inside strings they are escaped), but
        # xgrammar's string rule admits them; JSON rows also get this mask so every parser accepts the text.
        allowed = torch.ones(-(-self.vocab_size // 32) * 32, dtype=torch.bool)
        for token_id, raw in enumerate(info.decoded_vocab[:self.vocab_size]):
            if token_id not in self.stop_token_ids and any(b < 0x20 for b in raw):
                allowed[token_id] = False
        self._json_ok = _pack(allowed)
        self._xgr = xgrammar

    def compile(self, spec: StructuredOutput):
        """The compiled grammar for spec (cached by its canonical text). Raises ValueError naming the problem."""
        key = spec.key
        with self._lock:
            if self._xgr is None:
                self._init()
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
            kind, text = key
            try:
                if kind == "json_schema":
                    got = self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
                elif kind == "json_object":
                    got = self._compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
                elif kind == "regex":
                    got = self._compiler.compile_regex(text)
                else:
                    got = self._compiler.compile_regex("|".join(_escape(c) for c in spec.choice))
            except Exception as exc:        # xgrammar raises RuntimeError/ValueError with the parser's message
                raise ValueError(f"structured output {kind} cannot be compiled: {_reason(exc)}") from None
            self._cache[key] = got
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return got

    def warm(self) -> None:
        """Build the tokenizer tables and compile the JSON-object grammar now (seconds on the CPU), so the first
        structured request does not wait for them (the worker calls it, in the background, at start)."""
        self.compile(StructuredOutput(json_object=True))

    def matcher(self, spec: StructuredOutput, tokens: list[int] = ()):
        """A fresh matcher for spec, advanced over tokens already generated."""
        compiled = self.compile(spec)
        m = Grammar(self._xgr.GrammarMatcher(compiled), json=spec.key[0] in ("json_schema", "json_object"))
        for t in tokens:
            if not m.accept_token(t):
                raise ValueError(f"token {t} does not follow the grammar")
        return m

    def bitmask(self, matchers: list) -> tuple[torch.Tensor, list[int]] | None:
        """matchers: one per row of the step (None where unconstrained) ->
        (bitmask [S, ceil(V/32)] int32 on the device, the constrained rows), or None when no row is."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        if self._bitmask is None or self._bitmask.shape[0] < len(matchers):
            self._bitmask = torch.empty((max(len(matchers), 64), self._json_ok.numel()), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        mask = self._bitmask[:len(matchers)]
        for i in rows:
            matchers[i].matcher.fill_next_token_bitmask(mask, i)
            if matchers[i].json:
                mask[i] &= self._json_ok
        self.mask_s += time.perf_counter() - t0
        self.masked_rows += len(rows)
        return mask.to(self.device, non_blocking=True), rows


def apply_bitmask(logits: torch.Tensor, bitmask: tuple[torch.Tensor, list[int]]) -> None:
    """logits [S, V] in place: -inf wherever a constrained row's grammar forbids the token (xgrammar's
    CPU, CUDA or Triton kernel by device)."""
    import xgrammar

    mask, rows = bitmask
    xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1],
                                         indices=None if len(rows) == logits.shape[0] else rows)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[32 * W] bool -> [W] int32 bitmask, bit i of word w for token 32 * w + i (xgrammar's layout)."""
    words = allowed.view(-1, 32).to(torch.int64) << torch.arange(32)
    return words.sum(-1).to(torch.int64).apply_(lambda v: v - (1 << 32) if v >= 1 << 31 else v).to(torch.int32)


def _escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in text)


def _reason(exc: Exception) -> str:
    # xgrammar prefixes its messages with "[time] file.cc:line: "; keep the part a user can act on.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
