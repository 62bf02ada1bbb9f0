"""Drafters: cheap guesses of a sequence's next tokens, which the target model then verifies in one step
(speculative decoding, workers/engine/spec_decode.py).

A drafter proposes, for each sequence asked, up to k token ids; it may propose fewer (or none). Its guesses are
point masses (one token per position, no distribution), which is what lets verification sample from the target
alone (see spec_decode). Another drafter (suffix trees, EAGLE heads, a draft model) implements `propose`.
"""
from array import array

import torch

from tidepool.kernels.layer_ops import argmax_rows
from tidepool.workers.engine.block_manager import BlockManager
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.model_runner import ModelRunner
from tidepool.workers.engine.scheduler import ScheduledBatch
from tidepool.workers.engine.sequence import Sequence


class Drafter:
    method = "none"
    match_lengths: list[int] | None = None   # a drafter that can tell sets this per proposal: how much context
                                              # backs each draft (the n-gram drafter: the matched suffix's length)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """For each sequence, at most ks[i] token ids to follow its tokens so far."""
        raise NotImplementedError

    def forget(self, seq: Sequence) -> None:
        """seq finished: drop any state kept for it."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from max_n down to
    min_n) in its prompt and output, and propose the k tokens that followed it. `match_lengths` tells, per
    proposal, how long the match really is (counted back past max_n, up to MATCH_CAP tokens): how likely the
    continuation is to be copied (spec_decode reads acceptance by match length)."""
    method = "ngram"
    MATCH_CAP = 16

    def __init__(self, min_n: int = 1, max_n: int = 4, window: int = 4096):
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram drafter needs 1 <= min_n <= max_n")
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self.match_lengths = []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        found = [self.match(seq.token_ids, k) for seq, k in zip(seqs, ks)]
        self.match_lengths = [m for _, m in found]
        return [d for d, _ in found]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(the continuation of the latest match of the longest suffix, up to k tokens; the match's length)."""
        if k <= 0:
            return [], 0
        tokens = tokens[-self.window:]
        size = len(tokens)
        data = array("i", tokens).tobytes()     # bytes.rfind does the search in C; matches must sit on 4-byte edges
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = data[4 * (size - n):]
            end = 4 * (size - 1)                 # the match must leave at least one token after it
            at = data.rfind(tail, 0, end)
            while at > 0 and at % 4:
                at = data.rfind(tail, 0, at + len(tail) - 1)
            if at >= 0 and at % 4 == 0:
                start = at // 4 + n
                m = n          # extend the match backwards past max_n
                while m < self.MATCH_CAP and start - m > 0 and tokens[start - m - 1] == tokens[size - m - 1]:
                    m += 1
                return tokens[start:start + k], m
        return [], 0


class DraftModelDrafter(Drafter):
    """A smaller model sharing the target's tokenizer drafts greedily. It runs in the engine's process on its own
    small KV pool: per sequence a shadow holds the tokens whose KV the draft model has; each step it catches up
    on the tokens the target accepted since (one batched chunk over all drafting sequences, which also yields
    their first drafts), then takes k - 1 batched single-token steps. Drafts the target rejected are rolled back
    in the draft pool at the next proposal. When the pool is full the least recently used shadows are dropped
    (they catch up again later); a sequence that still does not fit drafts nothing this step."""
    method = "draft"

    def __init__(self, engine_config, draft_model: str, num_blocks: int | None = None):
        target = engine_config
        with open(f"{target.model}/tokenizer.json", "rb") as a, open(f"{draft_model}/tokenizer.json", "rb") as b:
            if a.read() != b.read():
                raise ValueError(f"draft model {draft_model!r} does not share the target's tokenizer")
        blocks = num_blocks or max(64, target.max_num_seqs * 4)
        self.config = EngineConfig(model=draft_model, device=target.device, dtype=target.dtype,
                                   block_size=target.block_size, num_kv_blocks=blocks,
                                   max_num_seqs=target.max_num_seqs, max_model_len=None,
                                   enable_prefix_caching=False, attention_backend=target.attention_backend,
                                   enforce_eager=True, sla_targets={}, calibrate=False)
        if self.config.model_config.vocab_size != target.model_config.vocab_size:
            raise ValueError("draft model's vocabulary size differs from the target's")
        self.runner = ModelRunner(self.config, self.config.model_config)
        self.blocks = BlockManager(self.runner.num_kv_blocks, target.block_size, enable_prefix_caching=False)
        self.max_len = min(self.config.max_model_len, self.runner.num_kv_blocks * target.block_size)
        self.shadows: dict[tuple[str, int], Sequence] = {}     # insertion order = least recently used first

    def _shadow(self, seq: Sequence) -> Sequence:
        key = (seq.request_id, seq.index)
        shadow = self.shadows.pop(key, None)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.token_ids[:1], seq.params)
        self.shadows[key] = shadow
        # Keep the longest prefix the draft cache holds that the sequence still agrees with.
        computed = shadow.num_computed_tokens
        same = 0
        for a, b in zip(shadow.token_ids[:computed], seq.token_ids):
            if a != b:
                break
            same += 1
        shadow.num_computed_tokens = min(same, seq.num_tokens - 1)
        self.blocks.rollback(shadow)
        shadow.token_ids = list(seq.token_ids)
        return shadow

    def _room(self, shadow: Sequence, n: int, keep: set) -> bool:
        while not self.blocks.allocate(shadow, n):
            victim = next((k for k, s in self.shadows.items() if k not in keep), None)
            if victim is None:
                return False
            self.blocks.free_sequence(self.shadows.pop(victim))
        return True

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        active = []                                   # (index, shadow, k)
        keep = {(s.request_id, s.index) for s in seqs}
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0 or seq.num_tokens + k > self.max_len:
                continue
            shadow = self._shadow(seq)
            if self._room(shadow, shadow.num_uncomputed_tokens + k - 1, keep):
                active.append((i, shadow, k))
            else:
                self.blocks.free_sequence(self.shadows.pop((seq.request_id, seq.index)))
        with torch.inference_mode():
            while active:
                batch = ScheduledBatch(seqs=[s for _, s, _ in active],
                                       num_new_tokens=[s.num_uncomputed_tokens for _, s, _ in active])
                tokens = argmax_rows(self.runner.run(batch)).tolist()
                still = []
                for (i, shadow, k), n, token in zip(active, batch.num_new_tokens, tokens):
                    shadow.num_computed_tokens += n
                    drafts[i].append(token)
                    if len(drafts[i]) < k:
                        shadow.token_ids.append(token)
                        still.append((i, shadow, k))
                active = still
        return drafts

    def forget(self, seq: Sequence) -> None:
        shadow = self.shadows.pop((seq.request_id, seq.index), None)
        if shadow is not None:
            self.blocks.free_sequence(shadow)
