"""A grammar that takes long to compile holds up only its own request: it compiles on a thread of its own, never under
the lock the engine thread takes for a request's n > 1 siblings, and never in the worker's intake thread, which keeps
claiming, running and writing other tenants' jobs meanwhile; past the worker's grammar budget its job fails with the
reason. The slow compile is a compile held on an event, so the order of events is what is checked, not timings."""
import threading

import pytest
from sqlalchemy.orm import Session

from tidepool.service.ledger import jobs as transitions
from tidepool.service.ledger.models import JobStatus, Usage
from tidepool.workers.engine import LLMEngine, SamplingParams
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.structured import StructuredOutput
from tidepool.workers.worker import Worker, WorkerConfig

from .test_intake import _close, _job, _run_engine

SLOW = {"type": "object", "properties": {"held": {"type": "string"}}, "required": ["held"]}
SLOW_TEXT = StructuredOutput(json_schema=SLOW).key[1]


class HeldCompiler:
    """The grammar compiler, except that SLOW's compile waits for `release` (set `entered` when it starts)."""

    def __init__(self, compiler):
        self.compiler = compiler
        self.entered, self.release = threading.Event(), threading.Event()

    def compile_json_schema(self, text, **kwargs):
        if text == SLOW_TEXT:
            self.entered.set()
            assert self.release.wait(120), "never released"
        return self.compiler.compile_json_schema(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.compiler, name)


def _hold(structured) -> HeldCompiler:
    structured.warm()                  # the tokenizer tables and the compiler exist
    held = HeldCompiler(structured._compiler)
    structured._compiler = held
    return held


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_decoding_and_n_siblings_go_on_while_another_grammar_compiles(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64))
    held = _hold(engine.structured)
    slow = _in_thread(lambda: engine.add_request("slow", [1, 2, 3], SamplingParams(
        max_tokens=4, structured={"json_schema": SLOW})))
    assert held.entered.wait(60)
    finished = []

    def decode():        # a structured request with n = 2: its siblings fork off on the engine's thread
        engine.add_request("other", [4, 5, 6], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=1,
                                                              structured={"json_object": True}))
        while not finished:
            finished.extend(o for o in engine.step() if o.finished and o.request_id == "other")

    other = _in_thread(decode)
    other.join(60)
    try:
        assert not other.is_alive() and not held.release.is_set()     # done while SLOW was still compiling
        assert len(finished[0].outputs) == 2
    finally:
        held.release.set()
    slow.join(60)
    assert not slow.is_alive()
    while engine.has_unfinished():       # SLOW, compiled at last, runs as usual
        engine.step()


def _grammar_worker(st, name: str, budget: float) -> Worker:
    w = Worker(WorkerConfig(model=st.model, database_url=st.db_url, broker_url=st.redis_url, redis_url=st.redis_url,
                            device="cpu", name=name, lease_seconds=30, grammar_budget=budget))
    w.connect()
    return w


def _submit_slow(st, key: str) -> str:
    r = st.app.test_client().post("/v1/jobs", headers={"Authorization": f"Bearer {key}"}, json={
        "max_tokens": 8, "messages": [{"role": "user", "content": "slow"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "held", "schema": SLOW}}})
    assert r.status_code == 202, r.get_json()
    return r.get_json()["id"]


def _pull(w: Worker) -> None:
    """One intake pass, which must not wait for any compile."""
    t = _in_thread(w.pull)
    t.join(60)
    assert not t.is_alive(), "the intake thread is stuck"


@pytest.mark.parametrize("budget", [30.0, 1e-6])
def test_other_tenants_jobs_run_while_a_grammar_compiles_and_a_late_one_fails(stack, budget):
    st = stack
    _, slow_key = st.tenant()
    _, other_key = st.tenant()
    slow_id = _submit_slow(st, slow_key)
    w = _grammar_worker(st, "grammar", budget)
    held = _hold(w.engine.structured)
    try:
        _pull(w)                                   # the slow job is claimed and waits for its grammar
        assert held.entered.wait(60) and [c.inf.job_id for c in w.intake.compiling] == [slow_id]
        [other] = st.submit(other_key, 1, prompt="meanwhile", max_tokens=3, ignore_eos=True)
        _pull(w)                                   # another tenant's job is claimed and enters the engine
        assert other in w.inflight
        job = _job(st, slow_id)
        if budget < 1:                             # past the budget: the job failed, with the reason
            assert job.status == JobStatus.failed and "took longer than" in job.error["message"], job.error
            assert slow_id not in w.inflight and not w.intake.compiling
        else:
            assert job.status == JobStatus.running
        _run_engine(w)
        w.finish_done()
        assert _job(st, other).status == JobStatus.completed and not held.release.is_set()
        held.release.set()
        if budget > 1:                             # compiled within it: into the engine, and done
            st.wait(lambda: w.pull() is not None and slow_id not in [c.inf.job_id for c in w.intake.compiling],
                    30, "the grammar")
            _run_engine(w)
            w.finish_done()
            assert _job(st, slow_id).status == JobStatus.completed
    finally:
        held.release.set()
        _close(w)


def test_a_job_cancelled_while_its_grammar_compiles_ends_cancelled_and_unbilled(stack):
    st = stack
    tenant_id, key = st.tenant()
    slow_id = _submit_slow(st, key)
    w = _grammar_worker(st, "grammar-cancel", 30.0)
    held = _hold(w.engine.structured)
    try:
        _pull(w)
        assert held.entered.wait(60)
        with Session(st.engine) as s:
            assert transitions.cancel(s, slow_id)
            s.commit()
        w.check_leases(renew=False)
        _pull(w)                                   # gone from the compiling ones, as an abort
        w.finish_done()
        job = _job(st, slow_id)
        assert (job.status, job.lease_token, job.completion_tokens) == (JobStatus.cancelled, None, 0)
        assert not w.inflight and not w.intake.compiling and not st.redis.hlen("unacked")
        with Session(st.engine) as s:
            assert s.query(Usage).filter_by(tenant_id=tenant_id).count() == 0
    finally:
        held.release.set()
        _close(w)


def test_length_and_item_bounds_cost_the_compiler_nothing(tiny_model):
    """Huge maxLength / maxItems / minItems do not make a grammar slow to compile (xgrammar repeats them in place):
    compiled well inside the worker's default budget."""
    engine = LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=16))
    engine.structured.warm()
    schema = {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string", "minLength": 10**6, "maxLength": 10**12},
        "b": {"type": "array", "minItems": 10**6, "maxItems": 10**9,
              "items": {"type": "array", "items": {"type": "string", "maxLength": 10**6}, "maxItems": 10**6}}}}
    compiling = _in_thread(lambda: engine.structured.compile(StructuredOutput(json_schema=schema)))
    compiling.join(WorkerConfig.grammar_budget)
    assert not compiling.is_alive()
