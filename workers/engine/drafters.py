"""Drafters: cheap guesses of a sequence's next tokens, which the target model then verifies in one step
(speculative decoding, workers/engine/spec_decode.py).

A drafter proposes, for each sequence asked, up to k token ids; it may propose fewer (or none). Its guesses are
point masses (one token per position, no distribution), which is what lets verification sample from the target
alone (see spec_decode). Another drafter (suffix trees, EAGLE heads, a draft model) implements `propose`.
"""
from array import array

from workers.engine.sequence import Sequence


class Drafter:
    method = "none"

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """For each sequence, at most ks[i] token ids to follow its tokens so far."""
        raise NotImplementedError

    def forget(self, seq: Sequence) -> None:
        """seq finished: drop any state kept for it."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from max_n down to
    min_n) in its prompt and output, and propose the k tokens that followed it."""
    method = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4, window: int = 4096):
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram drafter needs 1 <= min_n <= max_n")
        self.min_n, self.max_n, self.window = min_n, max_n, window

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
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
                return tokens[start:start + k]
        return []
