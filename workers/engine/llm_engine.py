"""LLMEngine: requests in, token streams out. Each `step()` is schedule -> run model -> sample -> postprocess."""
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from tidepool.workers.engine.block_manager import BlockManager
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.calibration import calibrate
from tidepool.workers.engine.cost_model import CostModel
from tidepool.workers.engine.encoder_runner import EncoderRunner
from tidepool.workers.engine.lora import LoRAManager, LoRARequest
from tidepool.workers.engine.model_runner import ModelRunner, trim_heap
from tidepool.workers.engine.openmp import release_team
from tidepool.workers.engine.pooling import PoolingParams
from tidepool.kernels.layer_ops import argmax_rows
from tidepool.workers.engine.sampler import Sampler
from tidepool.workers.engine.sampling_params import SamplingParams
from tidepool.workers.engine.scheduler import Scheduler
from tidepool.workers.engine.sequence import Sequence, SequenceStatus
from tidepool.workers.engine.spec_decode import Speculator, make_drafter
from tidepool.workers.engine.step_trace import StepTrace
from tidepool.workers.engine.structured import StructuredDecoding
from tidepool.workers.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class PromptTooLong(ValueError):
    """A prompt that leaves no room in the model's context for one generated token."""


@dataclass
class CompletionOutput:
    """One choice of a finished request."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None          # "stop" | "length" | "abort"
    new_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    logprobs: list[dict] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    # n / best_of > 1: the text, token ids, logprobs, delta and new tokens above are those of choice `index`
    # (each event is one choice's); the finished output lists the choices returned in `outputs` (always,
    # one for n = 1), and generated_tokens counts the tokens of every sequence (best_of included).
    index: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list)
    generated_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {"token_id", "logprob", "top"}
    prompt_logprobs: list[dict | None] | None = None
    # An embedding request: one vector per input, in order (prompt_token_ids: every input's tokens, concatenated)
    embeddings: list[list[float]] | None = None
    # Prompt tokens processed (computed or found in the prefix cache): all of them once a token was sampled; what
    # an abort during prefill got through (usage bills an aborted request for what it computed)
    num_prompt_processed: int = 0


class _Choice:
    """Per-sequence state the engine keeps beside each of a request's Sequences."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer):
        self.seq = seq
        self.detok = detok
        self.emitted = 0                      # characters of detok.text already handed out
        self.text = ""
        self.logprobs: list[dict] | None = [] if seq.params.logprobs is not None else None
        self.finish_reason: str | None = None


class _Request:
    """Per-request state: its choices (one sequence each; n / best_of > 1 fork off the first after prefill)."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, on_token, arrival: float):
        self.choices = [_Choice(seq, detok)]
        self.on_token = on_token
        self.prompt_logprobs: list[dict | None] | None = \
            None if seq.params.prompt_logprobs is None else [None] * seq.num_prompt_tokens
        self.arrival_time = arrival
        self.first_token_time: float | None = None
        self.quiet = False          # while a verify step emits several tokens: on_token gets them in one output

    @property
    def seq(self) -> Sequence:
        return self.choices[0].seq


class _EmbedRequest:
    """An embedding request: one prefill-only sequence per input (seq.index), a vector each when computed."""

    def __init__(self, seqs: list[Sequence], on_token, arrival: float):
        self.seqs = seqs
        self.vectors: list[list[float] | None] = [None] * len(seqs)
        self.left = len(seqs)
        self.on_token = on_token
        self.arrival_time = arrival

    @property
    def seq(self) -> Sequence:
        return self.seqs[0]


class _StepCut:
    """Called between two layers of a step's forward (ModelRunner.run): when an online request has arrived that
    Scheduler.cut_in_tenants says should not wait for the rest of the step, its first-token step runs right there,
    to its end and its first token; a later arrival may cut in again further on (a long step of a quiet engine,
    pace.py, may see several realtime arrivals, and each should not wait it out). What the step in flight was
    computing is unchanged: its forward's state lives in that forward, and the first-token steps' sequences write
    other cache slots."""

    def __init__(self, engine: "LLMEngine", batch, outputs: list):
        self.engine, self.batch, self.outputs = engine, batch, outputs
        self.layers = len(engine.runner.model.layers)
        self.seconds = 0.0        # spent in the steps run inside
        self.asked = 0            # arrivals already judged (those the answer was no for stay no as the step goes on)

    def __call__(self, layer: int) -> None:
        engine = self.engine
        if len(engine._inbox) <= self.asked:    # a list another thread replaces whole: no lock needed
            return
        with engine._lock:
            arrivals = [r.seq for r in engine._inbox[self.asked:]]
        self.asked += len(arrivals)
        remaining = self.batch.predicted_s * (self.layers - layer) / self.layers
        tenants = engine.scheduler.cut_in_tenants(self.batch, arrivals, remaining)
        if not tenants:
            return
        engine.runner.synchronize()    # on a GPU the outer step's queued layers are its time, not the cut-in step's
        start = t0 = time.perf_counter()
        self.outputs.extend(engine._drain_inbox(requests_only=True))
        self.asked = 0            # the inbox is drained: what arrives from now on is new
        while tenants:            # a cut-in step starts one tenant's prompts (as any step): the others' come next
            cut = engine.scheduler.schedule_cut_in(self.batch, tenants)
            if not cut:
                break
            engine._totals["step_cuts"] += 1
            engine._run(cut, [], t0, time.perf_counter(), self.outputs, cut_in=True)
            tenants -= {s.tenant for s in cut.seqs}
            t0 = time.perf_counter()
        self.seconds += time.perf_counter() - start


EMBED_SAMPLING = SamplingParams(max_tokens=1)    # what the scheduler's capacity checks read of an embedding input


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = Tokenizer(config.model)
        self.is_encoder = config.model_config.is_encoder
        self.runner = (EncoderRunner if self.is_encoder else ModelRunner)(config, config.model_config)
        # A sequence may never outgrow the whole pool, or it could never be scheduled again.
        self.max_model_len = min(config.max_model_len, self.runner.num_kv_blocks * config.block_size)
        num_blocks = self.runner.num_kv_blocks
        num_host_blocks = self.runner.num_host_blocks if self.runner.kv_cache else 0
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_host_blocks=num_host_blocks)
        self.lora = None if not config.max_loras else LoRAManager(
            self.runner.model, config.model_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
            self.runner.device, self.runner.dtype, self.runner.shard)
        self.runner.lora = self.lora
        if self.lora is not None and self.runner.group is not None:
            self.lora.on_fill = self.runner.send_lora_fill
        self.cost_model = CostModel()
        if config.calibrate:
            calibrate(self.cost_model, self.runner, num_blocks, config.block_size, config.max_num_seqs,
                      config.max_num_batched_tokens, self.max_model_len)
        if self.runner.device.type == "cpu":
            trim_heap()
        # The reserve never leaves offline work too little room for one sequence of max_model_len.
        reserve_blocks = min(int(config.online_reserve * num_blocks),
                             num_blocks - -(-self.max_model_len // config.block_size))
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, cost_model=self.cost_model,
            sla_targets=config.sla_targets, reserve_seats=min(int(config.online_reserve * config.max_num_seqs),
                                                              config.max_num_seqs - 1),
            reserve_blocks=max(0, reserve_blocks), capacity_policy=config.capacity_policy,
            max_model_len=self.max_model_len, offline_floor=config.offline_floor, kv_cache=self.runner.kv_cache,
            admit_gate=None if self.lora is None else lambda seq, running: self.lora.admissible(seq.lora, running))
        if self.lora is not None:
            self.lora.running, self.lora.waiting = self.scheduler.running, self.scheduler.waiting
        self.sampler = Sampler(self.runner.device)
        self.speculator = Speculator(config.speculative, make_drafter(config))
        self.eos_token_ids = set(config.model_config.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        self.structured = StructuredDecoding(config.model, config.model_config.vocab_size, sorted(self.eos_token_ids),
                                             self.runner.device)
        self.requests: dict[str, _Request] = {}
        self._inbox: list[_Request] = []
        self._inbox_ids: set[str] = set()     # the inbox's request ids (a duplicate check per add in O(1))
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)    # notified by add_request
        self._totals = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "computed_tokens": 0,
                        "schedule_s": 0.0, "model_s": 0.0, "sample_s": 0.0, "finished": 0, "aborted": 0,
                        "embedded_inputs": 0, "embedded_tokens": 0, "step_cuts": 0}
        self._last_step = {"tokens": 0, "seqs": 0, "schedule_s": 0.0, "model_s": 0.0, "sample_s": 0.0}
        self._trace = StepTrace(config.step_trace) if config.step_trace else None
        release_team()      # the thread stepping the engine (a worker's engine thread) then holds the only team

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    sla_class: str = "interactive", tenant: str = "default", weight: float = 1.0,
                    on_token: Callable[[RequestOutput], None] | None = None,
                    cache_namespace: str | None = None, lora: LoRARequest | None = None) -> None:
        """Queue a request (thread-safe). Raises ValueError for a prompt the engine cannot run.
        Prefix-cache blocks are shared only between requests of the same cache_namespace (and adapter).
        lora: run it through this LoRA adapter (LoRAError, a ValueError, if it does not fit the model).
        With PoolingParams it is an embedding request: `prompt` is a list of inputs (texts or token-id lists),
        one vector each in the finished output's `embeddings`."""
        if isinstance(params, PoolingParams):
            return self._add_embed(request_id, prompt, params, sla_class, tenant, weight, on_token)
        if self.is_encoder:
            raise ValueError("this is an embedding model: it cannot generate")
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt has {len(ids)} tokens, but this model's context is {self.max_model_len} tokens, "
                                f"prompt and output together: send fewer than {self.max_model_len}")
        vocab = self.config.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if lora is not None:
            if self.lora is None:
                raise ValueError("this engine serves no LoRA adapters (max_loras is 0)")
            self.lora.add(lora)
        seq = Sequence(request_id, ids, params, sla_class=sla_class, tenant=tenant, weight=weight,
                       cache_namespace=cache_namespace, lora=None if lora is None else lora.name)
        if params.structured is not None:
            seq.grammar = self.structured.matcher(params.structured)
        request = _Request(seq, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens), on_token,
                           time.time())
        self._queue(request)

    def _queue(self, request) -> None:
        with self._lock:
            if request.seq.request_id in self.requests or request.seq.request_id in self._inbox_ids:
                raise ValueError(f"request id {request.seq.request_id!r} is already in use")
            self._inbox.append(request)
            self._inbox_ids.add(request.seq.request_id)
            self._work.notify_all()

    @property
    def max_embed_len(self) -> int:
        """The most tokens one embedding input may have: the model's max_seq_length, within one step's budget."""
        return min(self.runner.pooling.max_seq_length or self.max_model_len, self.max_model_len,
                   self.config.max_num_batched_tokens)

    def embed_ids(self, inputs: list, params: PoolingParams) -> list[list[int]]:
        """Each input (text or token ids) as the token ids the model embeds: truncated to max_embed_len when
        params.truncate, else refused (PromptTooLong) when longer. Raises ValueError for an input it cannot run."""
        limit, vocab = self.max_embed_len, self.config.model_config.vocab_size
        if not inputs:
            raise ValueError("input is empty")
        out = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, max_length=limit if params.truncate else None)
            else:
                ids = list(item)[:limit] if params.truncate else list(item)
            if not ids:
                raise ValueError(f"input {i} is empty")
            if len(ids) > limit:
                raise PromptTooLong(f"input {i} has {len(ids)} tokens; this model embeds at most {limit} "
                                    f"(truncate them with truncate=true)")
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"input {i}: token ids must be in [0, {vocab})")
            out.append(ids)
        return out

    def _add_embed(self, request_id: str, inputs: list, params: PoolingParams, sla_class: str, tenant: str,
                   weight: float, on_token) -> None:
        seqs = []
        for i, ids in enumerate(self.embed_ids(inputs, params)):
            seq = Sequence(request_id, ids, EMBED_SAMPLING, sla_class=sla_class, tenant=tenant, weight=weight,
                           pooling=params)
            seq.index = i
            seqs.append(seq)
        self._queue(_EmbedRequest(seqs, on_token, time.time()))

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe); it finishes with reason "abort" at the next step."""
        with self._lock:
            self._aborts.append(request_id)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until has_unfinished() (thread-safe); False if the timeout passed first."""
        with self._lock:
            return bool(self._work.wait_for(lambda: self.requests or self._inbox, timeout))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests or self._inbox)

    def most_urgent_rank(self) -> int | None:
        """The rank (0 = realtime) of the most urgent SLA class among unfinished requests, those added but not yet
        taken in by a step included; None when there are none. Safe beside a step on another thread (the device
        stepper asks while one runs): the requests are copied in one go, and a request a step is taking in from
        the inbox at that moment may be missed (the caller knows the rank it had before the step)."""
        with self._lock:
            requests = list(self.requests.values())     # one copy in C: a step may change the dict meanwhile
            return min([r.seq.rank for r in requests] + [r.seq.rank for r in self._inbox], default=None)

    def _drain_inbox(self, requests_only: bool = False) -> list[RequestOutput]:
        """Take added requests into the scheduler, then aborts (not with requests_only: inside a step cut, where an
        aborted sequence of the step in flight must keep its blocks until that step ends)."""
        with self._lock:
            inbox, aborts = self._inbox, ([] if requests_only else self._aborts)
            self._inbox = []
            if not requests_only:
                self._aborts = []
            self._inbox_ids = set()
        for request in inbox:
            self.requests[request.seq.request_id] = request
            for seq in getattr(request, "seqs", None) or [request.seq]:
                self.scheduler.add(seq)
        outputs = []
        if requests_only:
            return outputs
        for request_id in aborts:
            request = self.requests.get(request_id)
            if request is not None:
                outputs.append(self._finish(request, "abort"))
        if self.lora is not None and (failed := self.lora.take_failed()):     # an adapter that would not load
            outputs += [self._finish(r, "abort") for r in list(self.requests.values()) if r.seq.lora in failed]
        return outputs

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        t0 = time.perf_counter()
        drafted = self.speculator.propose(self.scheduler, self.cost_model, self.max_model_len)
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        if drafted:
            in_batch = {id(s) for s in batch.seqs}
            for seq in drafted:
                if id(seq) not in in_batch:
                    seq.draft_token_ids = []
        if not batch:
            if self.lora is not None:
                self.lora.wait_loading(0.005)      # all there is to run waits on adapters being read: no busy loop
            return outputs
        return self._run(batch, drafted, t0, t1, outputs)

    def _run(self, batch, drafted, t0: float, t1: float, outputs: list, cut_in: bool = False) -> list[RequestOutput]:
        """Run a scheduled batch to its outputs (appended to `outputs`, returned); cut_in: it runs inside another
        step (_StepCut), which it may not cut in turn."""
        prompt_tokens = sum(min(n, max(0, s.num_prompt_tokens - s.num_computed_tokens))
                            for s, n in zip(batch.seqs, batch.num_new_tokens))
        counts = self._trace.count(batch) if self._trace is not None else None
        if batch.swap_out or batch.copies or batch.swap_in:
            self.runner.move_blocks(batch.swap_out, batch.copies, batch.swap_in)
        # (an engine without online targets, LLM and run-batch, has no arrival that could cut: no check per layer)
        cut = (_StepCut(self, batch, outputs) if self.config.step_cut and self.scheduler.pace.sla_targets and not cut_in
               and not self.is_encoder and batch.predicted_s and batch.num_adapters == 0 else None)
        logits = self.runner.run(batch, cut) if cut is not None else self.runner.run(batch)
        for seq, position, entry in self.runner.prompt_logprobs:    # a recomputed prompt writes the same again
            self.requests[seq.request_id].prompt_logprobs[position + 1] = entry
        t2 = time.perf_counter()
        ready = self.scheduler.postprocess(batch)
        if self.runner.embeddings:
            ready = [s for s in ready if s.pooling is None]
            outputs.extend(self._embedded(self.runner.embeddings))
        verify = []
        if drafted and ready:
            ready, logits, verify = self._split_verified(ready, logits)
        if ready:
            ready, logits = self._fork(ready, logits)
            tokens, logprobs = self.sampler(logits, ready, self.structured.bitmask([s.grammar for s in ready]))
            for seq, token, lp in zip(ready, tokens, logprobs):
                request = self.requests[seq.request_id]
                outputs.append(self._append_token(request, request.choices[seq.index], token, lp))
        for seq, rows in verify:
            outputs.append(self._verify(seq, rows))
        t3 = time.perf_counter()
        cut_s = 0.0 if cut is None else cut.seconds       # the step run inside this one is observed on its own
        self.cost_model.observe(batch.num_tokens, batch.attended, t3 - t0 - cut_s, batch.num_adapters)
        self._record(batch, prompt_tokens, t1 - t0, t2 - t1 - cut_s, t3 - t2)
        if self._trace is not None:
            self._trace.write(batch, counts, t0, t1, t2, t3, cut_s=cut_s, cut_in=cut_in)
        return outputs

    def _fork(self, ready: list[Sequence], logits):
        """A request of several sequences whose prompt was just computed: its siblings fork off the first
        one (sharing every prompt block), and each samples its first token from the same logits row."""
        rows, seqs = [], []
        for row, seq in enumerate(ready):
            rows.append(row)
            seqs.append(seq)
            request = self.requests[seq.request_id]
            if seq.index or seq.num_output_tokens or len(request.choices) >= seq.params.num_seqs:
                continue
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            for index in range(1, seq.params.num_seqs):
                child = seq.fork(index)
                self.block_manager.fork(seq, child)
                if seq.grammar is not None:     # the parent's grammar, compiled already: no compile on this thread
                    child.grammar = self.structured.sibling(seq.grammar)
                self.scheduler.add_forked(child)
                request.choices.append(_Choice(child, IncrementalDetokenizer(self.tokenizer, prompt,
                                                                             seq.params.skip_special_tokens)))
                rows.append(row)
                seqs.append(child)
        if len(seqs) == len(ready):
            return ready, logits
        return seqs, logits[rows]

    @staticmethod
    def _split_verified(ready: list[Sequence], logits):
        """Sequences that sample one row, their logits, and (sequence, its k + 1 rows) for those with drafts."""
        plain, rows, verify, at = [], [], [], 0
        for seq in ready:
            if seq.draft_token_ids:
                width = len(seq.draft_token_ids) + 1
                verify.append((seq, logits[at:at + width]))
                at += width
            else:
                plain.append(seq)
                rows.append(at)
                at += 1
        return plain, (logits[rows] if plain else None), verify

    def _verify(self, seq: Sequence, rows) -> RequestOutput:
        """Emit the target's tokens over a verify step's rows: row i is sampled as a decode step would after the
        i tokens before it, and the walk stops after the first token that differs from its draft (or when the
        sequence finishes). The accepted drafts' KV stays, the rest is rolled back. One output carries them all."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        request = self.requests[seq.request_id]
        choice = request.choices[seq.index]
        p = seq.params
        fast = seq.grammar is None and p.greedy and not p.has_penalties and not p.needs_logprob
        targets = argmax_rows(rows).tolist() if fast else None
        start = seq.num_computed_tokens
        accepted, events = 0, []
        request.quiet = True
        try:
            for i in range(len(drafts) + 1):
                if fast:
                    token, lp = targets[i], None
                else:
                    tokens, lps = self.sampler(rows[i:i + 1], [seq], self.structured.bitmask([seq.grammar]))
                    token, lp = tokens[0], lps[0]
                events.append(self._append_token(request, choice, token, lp))
                if choice.finish_reason is not None or i == len(drafts) or token != drafts[i]:
                    break
                accepted += 1
        finally:
            request.quiet = False
        if choice.finish_reason is None:
            seq.num_computed_tokens = start + accepted
            self.block_manager.rollback(seq)
            self.block_manager.commit(seq)
        self.speculator.record(seq, len(drafts), accepted)
        out = events[-1]
        if len(events) > 1:
            out.new_token_ids = [t for e in events for t in e.new_token_ids]
            out.delta_text = "".join(e.delta_text for e in events)
        if request.on_token is not None:
            request.on_token(out)
        return out

    def _append_token(self, request: _Request, choice: _Choice, token: int, logprob: dict | None) -> RequestOutput:
        seq, params = choice.seq, choice.seq.params
        now = time.time()
        if request.first_token_time is None:
            request.first_token_time = now
        seq.token_ids.append(token)
        self._totals["generation_tokens"] += 1
        if logprob is not None:
            seq.cumulative_logprob += logprob["logprob"]
        if choice.logprobs is not None:
            choice.logprobs.append(logprob)
        reason = None
        if seq.grammar is not None and (not seq.grammar.accept_token(token) or seq.grammar.is_terminated()):
            reason = "stop"       # the grammar is complete (a rejected token cannot happen under its mask)
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            reason = "stop"
        else:
            choice.detok.add(token)
            text = choice.detok.text
            for stop in params.stop:
                at = text.find(stop, max(0, len(choice.text) - len(stop)))
                if at != -1:
                    text, reason = text[:at], "stop"
                    break
            choice.text = text
        if reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None and choice.text == choice.detok.text:     # not cut at a stop string
            choice.detok.flush()
            choice.text = choice.detok.text
        if reason is not None:
            return self._finish(request, reason, new_tokens=[token], choice=choice)
        # Hold back text that could still turn out to be the start of a stop string.
        hold = max((len(s) - 1 for s in params.stop), default=0)
        return self._emit(request, choice, [token], upto=max(choice.emitted, len(choice.text) - hold))

    def _emit(self, request: _Request, choice: _Choice, new_tokens: list[int], upto: int, finished: bool = False,
              reason: str | None = None) -> RequestOutput:
        seq = choice.seq
        delta = choice.text[choice.emitted:upto]
        choice.emitted = upto
        out = RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=seq.output_token_ids, text=choice.text, finished=finished, finish_reason=reason,
            new_token_ids=new_tokens, delta_text=delta, logprobs=choice.logprobs,
            num_cached_tokens=request.seq.num_cached_tokens,
            num_preemptions=sum(c.seq.num_preemptions for c in request.choices),
            arrival_time=request.arrival_time, first_token_time=request.first_token_time,
            finished_time=time.time() if finished else None, index=seq.index,
            outputs=self._outputs(request) if finished else [],
            generated_tokens=sum(c.seq.num_output_tokens for c in request.choices),
            prompt_logprobs=request.prompt_logprobs,
            num_prompt_processed=seq.num_prompt_tokens if request.first_token_time is not None else
            min(request.seq.num_computed_tokens, seq.num_prompt_tokens))
        if request.on_token is not None and not request.quiet:
            request.on_token(out)
        return out

    @staticmethod
    def _outputs(request: _Request) -> list[CompletionOutput]:
        """The choices returned: all of them, or with best_of the n of highest cumulative logprob."""
        params = request.seq.params
        choices = request.choices
        if params.num_seqs > params.n:
            choices = sorted(choices, key=lambda c: c.seq.cumulative_logprob, reverse=True)[:params.n]
        return [CompletionOutput(i, c.text, c.seq.output_token_ids, c.finish_reason, c.logprobs,
                                 c.seq.cumulative_logprob) for i, c in enumerate(choices)]

    def _embedded(self, vectors: list) -> list[RequestOutput]:
        """Inputs pooled this step leave the scheduler; a request whose inputs all have theirs finishes."""
        outputs = []
        for seq, vector in vectors:
            request = self.requests[seq.request_id]
            request.vectors[seq.index] = vector
            request.left -= 1
            self.scheduler.remove(seq)
            self._totals["embedded_inputs"] += 1
            self._totals["embedded_tokens"] += seq.num_tokens
            if request.left == 0:
                outputs.append(self._finish_embed(request, "stop"))
        return outputs

    def _finish_embed(self, request: _EmbedRequest, reason: str) -> RequestOutput:
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
            seq.finish_reason = reason
        del self.requests[request.seq.request_id]
        self._totals["aborted" if reason == "abort" else "finished"] += 1
        now = time.time()
        out = RequestOutput(
            request_id=request.seq.request_id, prompt_token_ids=[t for s in request.seqs for t in s.token_ids],
            token_ids=[], text="", finished=True, finish_reason=reason, arrival_time=request.arrival_time,
            first_token_time=now, finished_time=now,
            embeddings=request.vectors if reason != "abort" else None,
            num_prompt_processed=sum(s.num_tokens for s, v in zip(request.seqs, request.vectors) if v is not None))
        if request.on_token is not None:
            request.on_token(out)
        return out

    def _finish(self, request: _Request, reason: str, new_tokens: list[int] | None = None,
                choice: _Choice | None = None) -> RequestOutput:
        """Finish one choice (without one: every unfinished choice, an abort). The request is finished when
        all its choices are (before the fork, an abort finishes it at once)."""
        if isinstance(request, _EmbedRequest):
            return self._finish_embed(request, reason)
        for c in [choice] if choice is not None else request.choices:
            if c.finish_reason is None:
                c.finish_reason = c.seq.finish_reason = reason
                self.scheduler.remove(c.seq)
                self.sampler.forget(c.seq.request_id, c.seq.index)
                self.speculator.forget(c.seq)
        choice = choice or request.choices[0]
        done = all(c.finish_reason is not None for c in request.choices) and \
            (len(request.choices) == request.seq.params.num_seqs or reason == "abort")
        if done:
            del self.requests[request.seq.request_id]
            self._totals["aborted" if reason == "abort" else "finished"] += 1
        return self._emit(request, choice, new_tokens or [], upto=len(choice.text), finished=done, reason=reason)

    # -- stats ----------------------------------------------------------------------------------
    def _record(self, batch, prompt_tokens: int, schedule_s: float, model_s: float, sample_s: float) -> None:
        t = self._totals
        t["steps"] += 1
        t["prompt_tokens"] += prompt_tokens
        t["computed_tokens"] += batch.num_tokens
        t["schedule_s"] += schedule_s
        t["model_s"] += model_s
        t["sample_s"] += sample_s
        self._last_step = {"tokens": batch.num_tokens, "seqs": len(batch.seqs), "schedule_s": schedule_s,
                           "model_s": model_s, "sample_s": sample_s, "predicted_s": batch.predicted_s,
                           "time_limit_s": batch.time_limit_s}

    def stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        by_class: dict[str, dict[str, int]] = {}
        for state, seqs in (("running", sched.running), ("waiting", sched.waiting)):
            for seq in seqs:
                by_class.setdefault(seq.sla_class, {"running": 0, "waiting": 0})[state] += 1
        with self._lock:
            inbox = len(self._inbox)
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting) + inbox,
            "by_class": by_class,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
            # the dtype the pool holds (kv_scales.resolve: "auto" where the calibration refused the one asked for)
            "kv_cache_dtype": self.config.kv_choice.in_use,
            "kv_quant_fallbacks": int(self.config.kv_choice.fallback is not None),
            "preemptions": sched.num_preemptions,
            # Room offline work may still take: the online reserve of seats and blocks is not in it.
            "offline_seats": sched.offline_seats(),
            "offline_seats_free": sched.offline_seats_free(),
            "offline_blocks_free": max(0, bm.num_free_blocks - sched.reserve_blocks),
            "preemptions_by_kind": dict(sched.preemptions),
            "recomputed_tokens": sched.recomputed_tokens,
            "swapped": sum(s.status == SequenceStatus.SWAPPED for s in sched.waiting),
            "suspended": sum(s.status == SequenceStatus.SUSPENDED for s in sched.waiting),
            "cost_model": self.cost_model.as_dict(),
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "forked_seqs": bm.forks,
            "cow_copies": bm.cow_copies,
            "structured_mask_s": self.structured.mask_s,
            "structured_masked_rows": self.structured.masked_rows,
            "spec_decode": self.speculator.stats(),
            "decode_graph_replays": self.runner.decode_graphs.replays if self.runner.decode_graphs else 0,
            "last_step": dict(self._last_step),
            **({} if self.lora is None else {"lora": self.lora.stats()}),
            **{f"total_{k}": v for k, v in self._totals.items()},
        }
