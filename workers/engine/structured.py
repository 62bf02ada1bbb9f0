"""Constrained decoding: grammars compiled once per schema (xgrammar), a matcher per sequence that
advances with each accepted token, and one token bitmask per step for every constrained row.

A matcher's state is a function of the sequence's output tokens only, so preemption (suspend, swap or
recompute) never touches it; `matcher(spec, tokens)` rebuilds one from tokens when needed.
"""
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import torch

from tidepool.workers.engine.sampling_params import StructuredOutput

MAX_CACHED_GRAMMARS = 512


# UTF-8 as a little automaton over bytes: the state is what the next byte must be. 0: a new character; 1-3: that
# many continuation bytes (0x80-0xBF) to go; 4-7: the second byte of E0 (A0-BF), ED (80-9F: no surrogates), F0
# (90-BF: no overlong) and F4 (80-8F: at most U+10FFFF), then 1, 1, 2, 2 continuation bytes.
_UTF8_RANGES = {1: (0x80, 0xBF, 0), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2), 4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1),
                6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}
UTF8_STATES = 8


def utf8_step(state: int, byte: int) -> int:
    """The state after `byte`, or -1 when the bytes so far cannot be valid UTF-8."""
    if state:
        lo, hi, then = _UTF8_RANGES[state]
        return then if lo <= byte <= hi else -1
    if byte < 0x80:
        return 0
    if 0xC2 <= byte <= 0xDF:
        return 1
    if 0xE0 <= byte <= 0xEF:
        return {0xE0: 4, 0xED: 5}.get(byte, 2)
    if 0xF0 <= byte <= 0xF4:
        return {0xF0: 6, 0xF4: 7}.get(byte, 3)
    return -1


def utf8_table(token_bytes: list[bytes]) -> list[list[int]]:
    """[state][token] -> the state after the token's bytes, -1 where they break UTF-8. A token without bytes (a
    special or stop token) keeps state 0 and is refused mid-character (the text would end in U+FFFD)."""
    table = [[-1] * len(token_bytes) for _ in range(UTF8_STATES)]
    for t, raw in enumerate(token_bytes):
        if raw.isascii():       # most of a vocabulary: only at a character boundary
            table[0][t] = 0
            continue
        for start in range(UTF8_STATES):
            state = start
            for b in raw:
                state = utf8_step(state, b)
                if state < 0:
                    break
            table[start][t] = state
    return table


class Grammar:
    """One sequence's place in its grammar, and in UTF-8 (the grammar library admits token bytes that are not
    valid UTF-8 inside strings, which decode to U+FFFD; utf8 is the automaton state above). compiled: the grammar
    it follows, for a sibling's fresh matcher (n > 1) without a compile."""
    __slots__ = ("matcher", "json", "utf8", "table", "compiled")

    def __init__(self, matcher, json: bool, table: list[list[int]] | None = None, compiled=None):
        self.matcher = matcher
        self.json = json
        self.utf8, self.table = 0, table
        self.compiled = compiled

    def accept_token(self, token: int) -> bool:
        if self.table is not None and token < len(self.table[0]):
            self.utf8 = max(0, self.table[self.utf8][token])
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
        self._compiling: dict[tuple[str, str], Future] = {}
        # The cache and the compiles in flight; never held while a grammar compiles (seconds for a hard schema), so
        # a thread that needs a compiled grammar never waits for another request's compile.
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()     # the tokenizer tables, built once
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
        raw = [bytes(b) for b in info.decoded_vocab[:self.vocab_size]]
        self.token_bytes = raw + [b""] * (self.vocab_size - len(raw))   # what each token spells, as the grammar sees it
        self._utf8 = utf8_table(self.token_bytes)
        words = self._json_ok.numel() * 32
        self._utf8_ok = [_pack(torch.cat([torch.tensor([s >= 0 for s in row], dtype=torch.bool),
                                          torch.zeros(words - len(row), dtype=torch.bool)]))
                         for row in self._utf8]
        self._xgr = xgrammar

    def prepare(self, spec: StructuredOutput, on_done=None) -> Future:
        """spec's compiled grammar as a future: done at once when cached, else compiled on a thread of its own (one
        compile per grammar in flight, shared by whoever asks meanwhile). Its `started` attribute is when the compile
        itself began (the tokenizer tables built), None until then; a grammar that cannot be compiled fails it with
        ValueError naming the problem. on_done(future) runs when it is done."""
        key = spec.key
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                future = Future()
                future.started = time.monotonic()
                future.set_result(got)
            else:
                future = self._compiling.get(key)
                if future is None:
                    future = self._compiling[key] = Future()
                    future.started = None
                    threading.Thread(target=self._compile_into, args=(spec, future), daemon=True,
                                     name="grammar-compile").start()
        if on_done is not None:
            future.add_done_callback(on_done)
        return future

    def compile(self, spec: StructuredOutput):
        """The compiled grammar for spec (cached by its canonical text), waiting for it. Raises ValueError naming the
        problem."""
        return self.prepare(spec).result()

    def _compile_into(self, spec: StructuredOutput, future: Future) -> None:
        key = spec.key
        try:
            with self._init_lock:
                if self._xgr is None:
                    self._init()
            future.started = time.monotonic()
            got = self._compile(spec)
        except BaseException as exc:
            with self._lock:
                self._compiling.pop(key, None)
            future.set_exception(exc)
            return
        with self._lock:
            self._compiling.pop(key, None)
            self._cache[key] = got
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        future.set_result(got)

    def _compile(self, spec: StructuredOutput):
        kind, text = spec.key
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_regex("|".join(_escape(c) for c in spec.choice))
        except Exception as exc:        # xgrammar raises RuntimeError/ValueError with the parser's message
            raise ValueError(f"structured output {kind} cannot be compiled: {_reason(exc)}") from None

    def warm(self) -> None:
        """Build the tokenizer tables and compile the JSON-object grammar now (seconds on the CPU), so the first
        structured request does not wait for them (the worker calls it, in the background, at start)."""
        self.compile(StructuredOutput(json_object=True))

    def matcher(self, spec: StructuredOutput, tokens: list[int] = ()):
        """A fresh matcher for spec, advanced over tokens already generated."""
        compiled = self.compile(spec)
        m = Grammar(self._xgr.GrammarMatcher(compiled), json=spec.key[0] in ("json_schema", "json_object"),
                    table=self._utf8, compiled=compiled)
        for t in tokens:
            if not m.accept_token(t):
                raise ValueError(f"token {t} does not follow the grammar")
        return m

    def sibling(self, grammar: Grammar) -> Grammar:
        """A fresh matcher over the grammar another sequence follows (its request's n > 1 siblings): no compile."""
        return Grammar(self._xgr.GrammarMatcher(grammar.compiled), json=grammar.json, table=grammar.table,
                       compiled=grammar.compiled)

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
            m = matchers[i]
            m.matcher.fill_next_token_bitmask(mask, i)
            if m.json:
                mask[i] &= self._json_ok
            row = mask[i] & self._utf8_ok[m.utf8]
            if bool(row.any()):     # (never empty under a grammar over whole characters; if it were, keep its mask)
                mask[i] = row
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
