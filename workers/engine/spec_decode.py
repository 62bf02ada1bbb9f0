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

Policy (SLA-aware): a sequence speculates only while the cost model predicts it pays. Each draft position is
accepted with an estimated probability a: by the match length when the drafter tells it (the n-gram drafter: a
continuation backed by a 16-token match is copied far more often than one backed by a single token; a rate per
class and match length, learned from verified drafts from a prior), else by the class's rate, times the
sequence's own record (accepted over expected, decayed: a sequence whose drafts miss stops drafting within a few
steps, and tries one draft token every RETRY_EVERY steps). k drafts yield E(k) = 1 + a + ... + a^k tokens for a
step predicted at T + D(k) (the batch's step without drafts, plus the extra tokens' cost).
  - Online sequences (realtime, interactive) with no offline work beside them take the k that maximises
    E(k) / (T + D(k)) (0: no draft); the scheduler trims drafts that would break the step's itl bound.
  - Beside offline work, every draft position, online or offline, must raise the step's predicted tokens per
    second (its expected token a^i per extra second beats the batch's rate): the time drafts take is time
    offline tokens would use, so online drafts stretch an offline-carrying step only where they pay their way.
  - Offline sequences speculate only while the engine is not full (nothing waits for a seat or blocks).
  - A sequence's expected accepted drafts (`Sequence.draft_expected`, from `draft_acceptance`) count as delivered
    in the scheduler's pace room: a stream that gets several tokens from a step can absorb a longer one, and
    offline tokens fill it.
The cost model is fitted from measured steps; a verify step's k + 1 positions are attended as decode rows
(model_runner), so a step with drafts costs what its extra rows cost and no more.
"""
from tidepool.workers.engine.config import SpeculativeConfig
from tidepool.workers.engine.drafters import DraftModelDrafter, Drafter, NgramDrafter
from tidepool.workers.engine.sequence import SLA_CLASSES, Sequence, SequenceStatus, expected_tokens

PRIOR_ACCEPTANCE = 0.5      # a class's acceptance before anything was verified (drafts without a match length)
MATCH_BUCKETS = (1, 2, 3, 4, 8, 16)       # match lengths (lower edges) with a rate of their own
PRIOR_BY_MATCH = (0.3, 0.65, 0.8, 0.85, 0.9, 0.95)    # their acceptance before anything was verified
PRIOR_WEIGHT = 8            # draft positions a prior counts as
DECAY = 0.7                 # per verify step, for a sequence's own record
RETRY_EVERY = 8             # a sequence not worth drafting for tries one draft token this often
MAX_ACCEPTANCE = 0.98
MIN_ACCEPTANCE = 0.15       # below this a sequence does not draft (but for its probes): the cost model's few
                            # milliseconds per extra token leave out what a verify step costs besides
OWN_PRIOR = 0.5             # a sequence's record starts at this many expected and accepted tokens


def match_bucket(length: int | None) -> int | None:
    if not length:
        return None
    return max(i for i, edge in enumerate(MATCH_BUCKETS) if length >= edge)


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
        # (class, match bucket) -> [accepted, tried] draft positions
        self._by_match: dict[tuple[str, int], list[int]] = {}
        # (request, index) -> [accepted, expected accepted (decayed), idle steps, match bucket of the pending draft]
        self._seq: dict[tuple[str, int], list] = {}
        self._probes: set[tuple[str, int]] = set()    # sequences whose k this step is a probe (choose_k)
        self.last = [0, 0, 0]       # the last step's [verifying sequences, drafted, accepted] (traces, benchmarks)

    # -- policy -------------------------------------------------------------------------------------
    def _state(self, seq: Sequence) -> list:
        return self._seq.setdefault((seq.request_id, seq.index), [0.0, 0.0, 0, None])

    def base_acceptance(self, seq: Sequence, bucket: int | None = None) -> float:
        """The class's rate for drafts of this match bucket (None: the class's overall rate)."""
        if bucket is not None:
            accepted, tried = self._by_match.get((seq.sla_class, bucket), (0, 0))
            return (accepted + PRIOR_WEIGHT * PRIOR_BY_MATCH[bucket]) / (tried + PRIOR_WEIGHT)
        t = self.tallies[seq.sla_class]
        return (t.accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (t.tried + PRIOR_WEIGHT)

    def acceptance(self, seq: Sequence, bucket: int | None = None) -> float:
        """Estimated probability that a draft position of seq is accepted: the class's rate (by match bucket)
        times the sequence's own record, accepted over expected (1 before it has one)."""
        state = self._seq.get((seq.request_id, seq.index))
        own = 1.0 if state is None else (state[0] + OWN_PRIOR) / (state[1] + OWN_PRIOR)
        return min(MAX_ACCEPTANCE, self.base_acceptance(seq, bucket) * own)

    def room(self, seq: Sequence, max_model_len: int) -> int:
        """Most drafts seq may take: none past max_tokens (the last emitted token is the target's) or the context."""
        return min(self.config.num_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                   max_model_len - seq.num_tokens)

    @staticmethod
    def _extra(cost, seq: Sequence, k: int) -> float:
        return cost.per_token * k + cost.per_context * k * (seq.num_tokens + k / 2)

    def choose_k(self, seq: Sequence, most: int, step_s: float, cost, acceptance: float | None = None) -> int:
        """The k <= most that maximises expected tokens per second of seq's step."""
        if not self.config.adaptive or cost is None:
            return most
        a = self.acceptance(seq) if acceptance is None else acceptance
        best, best_rate = 0, 1.0 / max(step_s, 1e-9)
        for k in range(1, most + 1 if a >= MIN_ACCEPTANCE else 1):
            rate = expected_tokens(a, k) / max(step_s + self._extra(cost, seq, k), 1e-9)
            if rate > best_rate:
                best, best_rate = k, rate
        key = (seq.request_id, seq.index)
        self._probes.discard(key)
        if best == 0:
            state = self._state(seq)
            state[2] += 1
            if state[2] % RETRY_EVERY == 0:
                best = 1         # keep measuring: acceptance changes as the text does
                self._probes.add(key)
        return best

    def propose(self, scheduler, cost, max_model_len: int) -> list[Sequence]:
        """Give eligible running decodes their drafts for this step; returns the sequences that got some."""
        self.last = [0, 0, 0]
        if not self.config.enabled or self.drafter is None:
            return []
        running = [s for s in scheduler.running if s.status == SequenceStatus.RUNNING
                   and s.num_uncomputed_tokens == 1 and s.params.speculate]
        if not running:
            return []
        step_s = cost.predict(len(running), sum(s.num_tokens for s in running),
                              len({s.lora for s in running if s.lora is not None})) if cost is not None else 0.0
        full = bool(scheduler.waiting) or len(scheduler.running) >= scheduler.max_num_seqs
        beside_offline = any(not s.is_online for s in scheduler.running)
        candidates = [s for s in running if s.is_online or not full]
        seqs, mosts = [], []
        for seq in candidates:
            most = self.room(seq, max_model_len)
            if most > 0:
                seqs.append(seq)
                mosts.append(most)
        if not seqs:
            return []
        by_match = self.drafter.match_lengths is not None
        if by_match:     # drafting is cheap and tells how likely each draft is: draft in full, then choose k
            drafts = self.drafter.propose(seqs, mosts)
            lengths = self.drafter.match_lengths
            buckets = [match_bucket(m) for m in lengths] if len(lengths) == len(seqs) else [None] * len(seqs)
        else:            # a draft model: choose k first, at the sequence's overall rate
            ks = [self.choose_k(s, m, step_s, cost) for s, m in zip(seqs, mosts)]
            drafts = self.drafter.propose(seqs, ks)
            buckets = [None] * len(seqs)
        picked = []
        adaptive = self.config.adaptive and cost is not None
        for seq, draft, bucket in zip(seqs, drafts, buckets):
            if not draft:
                continue
            a = self.acceptance(seq, bucket)
            if by_match:
                draft = draft[:self.choose_k(seq, len(draft), step_s, cost, a)]
            if draft:
                self._state(seq)[3] = bucket
                picked.append((seq, draft, a))
        if adaptive and (beside_offline or any(not s.is_online for s, _, _ in picked)):
            picked = self._worth_it(picked, len(running), step_s, cost, beside_offline)
        chosen = []
        for seq, draft, a in picked:
            seq.draft_token_ids = list(draft)
            seq.draft_acceptance = a
            chosen.append(seq)
        return chosen

    def _worth_it(self, picked, batch_tokens: int, step_s: float, cost, beside_offline: bool):
        """Draft positions beside offline work (or offline ones), best first, while each adds expected tokens
        faster than the batch makes them: position i of a draft at acceptance a adds a^i tokens for one more
        token's cost. Online drafts with no offline work here keep the k choose_k gave them. A probe is judged
        at the prior: by the acceptance it is there to re-measure it would never run."""
        items, keep = [], {}
        for j, (seq, draft, a) in enumerate(picked):
            if not beside_offline and seq.is_online:
                keep[j] = len(draft)
                continue
            probe = (seq.request_id, seq.index) in self._probes
            p = max(a, PRIOR_ACCEPTANCE) if probe else a
            for i in range(1, len(draft) + 1):
                extra = cost.per_token + cost.per_context * (seq.num_tokens + i)
                items.append((p ** i / max(extra, 1e-12), i, j, p ** i, extra))
        items.sort(key=lambda x: (-x[0], x[1]))
        tokens, seconds = float(batch_tokens), step_s
        for _, i, j, gain, extra in items:
            if keep.get(j, 0) != i - 1:
                continue           # positions go in order
            if (tokens + gain) / (seconds + extra) <= tokens / max(seconds, 1e-12):
                break
            tokens, seconds = tokens + gain, seconds + extra
            keep[j] = i
        return [(seq, draft[:keep[j]], a) for j, (seq, draft, a) in enumerate(picked) if keep.get(j)]

    # -- outcome ------------------------------------------------------------------------------------
    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        t = self.tallies[seq.sla_class]
        t.drafted += drafted
        t.accepted += accepted
        t.verify_steps += 1
        tried = accepted + (accepted < drafted)
        t.tried += tried
        self.last[0] += 1
        self.last[1] += drafted
        self.last[2] += accepted
        state = self._state(seq)
        bucket, state[3] = state[3], None
        if bucket is not None:
            tally = self._by_match.setdefault((seq.sla_class, bucket), [0, 0])
            tally[0] += accepted
            tally[1] += tried
        # the sequence's record: what it accepted against what its class's rate expected of it
        a = self.base_acceptance(seq, bucket)
        expected = sum(a ** i for i in range(1, drafted + 1))
        state[0] = DECAY * state[0] + accepted
        state[1] = DECAY * state[1] + expected

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
