"""Turn the last-position logits of a step into next tokens: penalties, temperature, top-k/top-p,
per-request seeded sampling, and top-N log-probabilities."""
import torch

from tidepool.kernels.layer_ops import argmax_rows
from tidepool.workers.engine.sequence import Sequence
from tidepool.workers.engine.structured import apply_bitmask


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self.generators: dict[str, torch.Generator] = {}

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """The sequence's own random stream: seeded with seed + its index among its request's sequences."""
        g = self.generators.get((seq.request_id, seq.index))
        if g is None:
            g = torch.Generator(device=self.device)
            if seq.params.seed is None:
                g.seed()
            else:
                g.manual_seed(seq.params.seed + seq.index)
            self.generators[(seq.request_id, seq.index)] = g
        return g

    def forget(self, request_id: str, index: int = 0) -> None:
        self.generators.pop((request_id, index), None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], bitmask=None):
        """logits [S, V] (the model's dtype) -> (token ids [S], per-row logprob info or None). bitmask: the constrained
        rows' allowed tokens (StructuredDecoding.bitmask), or None."""
        if bitmask is None and all(s.params.greedy and not s.params.has_penalties and not s.params.needs_logprob
                                   for s in seqs):
            return argmax_rows(logits).tolist(), [None] * len(seqs)     # all greedy: no copy, no softmax
        logits = logits.float().clone()
        raw_logprobs = None
        if any(s.params.needs_logprob for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if bitmask is not None:
            apply_bitmask(logits, bitmask)
        for i, seq in enumerate(seqs):
            if seq.params.has_penalties:
                self._apply_penalties(logits[i], seq)
        tokens = argmax_rows(logits)     # torch.argmax(dim=-1), natively on CPU
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                continue
            row = logits[i] / p.temperature
            if p.top_k and p.top_k < row.numel():
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)
                cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
                drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p     # keep the token that crosses top_p
                row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
            probs = torch.softmax(row, dim=-1)
            if p.min_p > 0.0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, using only this request's generator.
            noise = torch.empty_like(probs).exponential_(generator=self.generator_for(seq))
            tokens[i] = (probs / noise).argmax()
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, seqs, token_list)

    def _apply_penalties(self, row: torch.Tensor, seq: Sequence) -> None:
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if seq.num_output_tokens and (p.frequency_penalty or p.presence_penalty):
            out = torch.tensor(seq.output_token_ids, device=row.device)
            counts = torch.zeros_like(row).scatter_add_(0, out, torch.ones_like(out, dtype=row.dtype))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, seqs: list[Sequence], tokens: list[int]):
        if raw is None:
            return [None] * len(seqs)
        result = []
        for i, seq in enumerate(seqs):
            if not seq.params.needs_logprob:
                result.append(None)
                continue
            n = seq.params.logprobs or 0      # None here: only the sampled token's, to rank best_of
            top = torch.topk(raw[i], n) if n else None
            result.append({
                "token_id": tokens[i],
                "logprob": raw[i, tokens[i]].item(),
                "top": list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
            })
        return result
