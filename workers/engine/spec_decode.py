"""Speculative decoding: which running sequences draft how many tokens this step, and what came of it.

Each step, before scheduling, `Speculator.propose` gives some decoding sequences `draft_token_ids` (a drafter's
guesses, workers/engine/drafters.py). The scheduler counts them as extra new tokens of the sequence (trimming
them to the step's token and time budget), the runner computes the k drafts and the last token as one chunk of
k + 1 positions and returns the logits of all of them, and the engine walks the rows (`LLMEngine._verify`):
row i is sampled exactly as a decode step would sample it after the i tokens before it, and the walk goes on
while the sampled token equals the draft. So each emitted token is the target's own, and the rows past the
first disagreement are dropped: their KV entries are rolled back (BlockManager.rollback) and never enter the
prefix cache. Greedy outputs are those of a run without speculation token for token; grammars, penalties, stop
strings, max_tokens, logprobs and n > 1 keep their meaning, because each accepted token goes through the same
sampling and bookkeeping as a decoded one. A seeded sequence even draws the same random numbers: one draw per
emitted token, in order.

Sampling: drafts are point masses q = δ(d). The standard rule (Leviathan et al. 2023, Chen et al. 2023) accepts
d with probability min(1, p(d) / q(d)) = p(d) and otherwise samples from norm(max(0, p - q)), which is p with d
taken out. Drawing t ~ p and accepting iff t == d does both in one draw (accept: probability p(d); reject: t is
distributed as p given t != d), so the output distribution is the target's.

Policy (SLA-aware): a sequence speculates only while the cost model predicts it pays. With acceptance rate a
(per sequence, decayed; the class's rate before it has its own) k drafts are expected to yield
E(k) = 1 + a + ... + a^k tokens for a step predicted at T + D(k) (the batch's step without drafts, plus the
extra tokens' cost); k is the one that maximises E(k) / (T + D(k)) (0: no draft). Online sequences
(realtime, interactive) take that k; the scheduler then trims drafts that would break the step's itl bound.
Offline sequences speculate only while the engine is not full (nothing waits for a seat or blocks) and only
as long as each one's expected extra tokens per extra second beat the batch's predicted tokens per second,
so speculation raises predicted throughput or does not happen; the cost model is fitted from measured steps.
"""
from workers.engine.config import SpeculativeConfig
from workers.engine.drafters import DraftModelDrafter, Drafter, NgramDrafter
from workers.engine.sequence import SLA_CLASSES, Sequence, SequenceStatus

PRIOR_ACCEPTANCE = 0.5      # a class's acceptance before anything was verified
DECAY = 0.7                 # per verify step, for a sequence's acceptance
RETRY_EVERY = 8             # a sequence not worth drafting for tries one draft token this often


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify step of k drafts yields when each draft is accepted with this probability."""
    return sum(acceptance ** i for i in range(k + 1))


class _Tally:
    __slots__ = ("drafted", "accepted", "verify_steps", "tried")

    def __init__(self):
        self.drafted = self.accepted = self.verify_steps = 0
        self.tried = 0          # draft positions the target looked at: accepted ones and the first rejected


def make_drafter(engine_config) -> Drafter | None:
    spec = engine_config.speculative
    if spec.method == "ngram":
        return NgramDrafter(spec.min_n, spec.max_n)
    if spec.method == "draft":
        return DraftModelDrafter(engine_config, spec.draft_model, spec.draft_kv_blocks)
    return None


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None):
        self.config = config
        self.drafter = drafter or (NgramDrafter(config.min_n, config.max_n) if config.method == "ngram" else None)
        self.tallies: dict[str, _Tally] = {c: _Tally() for c in SLA_CLASSES}
        self._seq: dict[tuple[str, int], list[float]] = {}    # (request, index) -> [accepted, tried, idle steps]
        self._probes: set[tuple[str, int]] = set()    # sequences whose k this step is a probe (choose_k)

    # -- policy -------------------------------------------------------------------------------------
    def acceptance(self, seq: Sequence) -> float:
        state = self._seq.get((seq.request_id, seq.index))
        if state is not None and state[1] > 0:
            return state[0] / state[1]
        t = self.tallies[seq.sla_class]
        return t.accepted / t.tried if t.tried else PRIOR_ACCEPTANCE

    def room(self, seq: Sequence, max_model_len: int) -> int:
        """Most drafts seq may take: none past max_tokens (the last emitted token is the target's) or the context."""
        return min(self.config.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                   max_model_len - seq.num_tokens)

    def choose_k(self, seq: Sequence, most: int, step_s: float, cost) -> int:
        """The k <= most that maximises expected tokens per second of seq's step."""
        if not self.config.adaptive or cost is None:
            return most
        a = self.acceptance(seq)
        best, best_rate = 0, 1.0 / max(step_s, 1e-9)
        for k in range(1, most + 1):
            extra = cost.per_token * k + cost.per_context * k * (seq.num_tokens + k / 2)
            rate = expected_tokens(a, k) / max(step_s + extra, 1e-9)
            if rate > best_rate:
                best, best_rate = k, rate
        key = (seq.request_id, seq.index)
        self._probes.discard(key)
        if best == 0:
            state = self._seq.setdefault(key, [0.0, 0.0, 0])
            state[2] += 1
            if state[2] % RETRY_EVERY == 0:
                best = 1         # keep measuring: acceptance changes as the text does
                self._probes.add(key)
        return best

    def propose(self, scheduler, cost, max_model_len: int) -> list[Sequence]:
        """Give eligible running decodes their drafts for this step; returns the sequences that got some."""
        if not self.config.enabled or self.drafter is None:
            return []
        running = [s for s in scheduler.running if s.status == SequenceStatus.RUNNING
                   and s.num_uncomputed_tokens == 1 and s.params.speculate]
        if not running:
            return []
        step_s = cost.predict(len(running), sum(s.num_tokens for s in running)) if cost is not None else 0.0
        full = bool(scheduler.waiting) or len(scheduler.running) >= scheduler.max_num_seqs
        online = [s for s in running if s.is_online]
        offline = [] if full else [s for s in running if not s.is_online]
        chosen = []
        for group in (online, offline):
            seqs, ks = [], []
            for seq in group:
                most = self.room(seq, max_model_len)
                k = self.choose_k(seq, most, step_s, cost) if most > 0 else 0
                if k > 0:
                    seqs.append(seq)
                    ks.append(k)
            if not seqs:
                continue
            drafts = self.drafter.propose(seqs, ks)
            picked = [(s, d) for s, d in zip(seqs, drafts) if d]
            if group is offline and self.config.adaptive and cost is not None:
                picked = self._worth_it(picked, len(running), step_s, cost)
            for seq, draft in picked:
                seq.draft_token_ids = list(draft)
                chosen.append(seq)
        return chosen

    def _worth_it(self, picked, batch_tokens: int, step_s: float, cost):
        """Offline drafts, best first, while each adds expected tokens faster than the batch makes them. A probe
        is judged at the prior acceptance: by the acceptance it is there to re-measure it would never run, and a
        sequence whose first draft missed (a copy not begun yet) would never draft again."""
        scored, out = [], []
        for seq, draft in picked:
            k = len(draft)
            extra = cost.per_token * k + cost.per_context * k * (seq.num_tokens + k / 2)
            probe = (seq.request_id, seq.index) in self._probes
            gain = expected_tokens(PRIOR_ACCEPTANCE if probe else self.acceptance(seq), k) - 1
            scored.append((gain / max(extra, 1e-12), seq, draft, gain, extra))
        scored.sort(key=lambda x: -x[0])
        tokens, seconds = float(batch_tokens), step_s
        for _, seq, draft, gain, extra in scored:
            if (tokens + gain) / (seconds + extra) <= tokens / max(seconds, 1e-12):
                break
            tokens, seconds = tokens + gain, seconds + extra
            out.append((seq, draft))
        return out

    # -- outcome ------------------------------------------------------------------------------------
    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        t = self.tallies[seq.sla_class]
        t.drafted += drafted
        t.accepted += accepted
        t.verify_steps += 1
        t.tried += accepted + (accepted < drafted)
        state = self._seq.setdefault((seq.request_id, seq.index), [0.0, 0.0, 0])
        state[0] = DECAY * state[0] + accepted
        state[1] = DECAY * state[1] + accepted + (accepted < drafted)

    def forget(self, seq: Sequence) -> None:
        self._seq.pop((seq.request_id, seq.index), None)
        self._probes.discard((seq.request_id, seq.index))
        if self.drafter is not None:
            self.drafter.forget(seq)

    def stats(self) -> dict:
        """{method: {class: drafted, accepted, verify_steps, acceptance_rate, mean_accepted_length}}; the mean
        accepted length counts the target's own token: tokens emitted per verify step."""
        if not self.config.enabled:
            return {}
        out = {}
        for cls, t in self.tallies.items():
            out[cls] = {"drafted": t.drafted, "accepted": t.accepted, "verify_steps": t.verify_steps,
                        "acceptance_rate": t.accepted / t.drafted if t.drafted else 0.0,
                        "mean_accepted_length": 1 + t.accepted / t.verify_steps if t.verify_steps else 0.0}
        return {self.config.method: out}
