"""Routing by model with real worker processes over two random-weight models of different
architectures: each job runs on its own model (outputs equal that model's own LLM.generate), a model no live
worker serves keeps its jobs queued and shown so, never failed, until a worker for it starts; a worker without
--models serves every enabled model whose weights fit its budget; one process serving both models
(`tidepool worker --models a,b`) survives kill -9 with every job completed exactly once."""
import json
import signal

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from tidepool.service.ledger.models import Job, JobStatus
from tidepool.service.ledger.snapshots import HEARTBEAT_KEY
from tidepool.workers.engine import LLM, SamplingParams

ADMIN = {"Authorization": "Bearer admin"}


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    from tidepool.workers.tools.tiny_model import make_tiny_model
    return str(make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen"), arch="qwen2", seed=7,
                               hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2))


def _register(stack, name, folder):
    r = stack.app.test_client().post("/v1/admin/models", json={"name": name, "source": folder, "tier": "hot"},
                                     headers=ADMIN)
    assert r.status_code == 201, r.get_json()


def _expected(folder, prompts, max_tokens):
    llm = LLM(folder, device="cpu")
    return [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))]


def _queues(stack):
    rows = stack.app.test_client().get("/v1/admin/queues", headers=ADMIN).get_json()["models"]
    return {(r["model"], r["sla_class"]): (r["depth"], r["served"]) for r in rows}


def test_each_model_runs_its_own_jobs_and_an_unserved_model_waits(stack, qwen_model):
    _register(stack, "qwen", qwen_model)
    _, key = stack.tenant()
    stack.start("worker", "--device", "cpu", "--models", "qwen", wait_for="wq", TIDEPOOL_WORKER_NAME="wq")
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    q_ids = [stack.submit(key, 1, prompt=f"qwen {i}", model="qwen", sla_class=c, **body)[0]
             for i, c in enumerate(("interactive", "batch", "realtime"))]
    t_ids = [stack.submit(key, 1, prompt=f"tiny {i}", **body)[0] for i in range(2)]     # the default model
    stack.wait(lambda: stack.count(Job.id.in_(q_ids), Job.status == JobStatus.completed) == 3, 120, "qwen jobs")
    got = {j.request["prompt"]: j for j in stack.jobs(Job.id.in_(q_ids))}
    want = _expected(qwen_model, [f"qwen {i}" for i in range(3)], 6)
    assert [got[f"qwen {i}"].output for i in range(3)] == want
    assert {j.model for j in got.values()} == {"qwen"} and {j.worker for j in got.values()} == {"wq"}

    # nobody serves the default model: its jobs stay queued, visible as such, and are not failed
    stack.wait(lambda: _queues(stack)[("qwen", "interactive")][1], 30, "qwen served in the queues view")
    assert stack.count(Job.id.in_(t_ids), Job.status == JobStatus.queued) == 2
    default = stack.app.config["TIDEPOOL"].served_model_name
    assert _queues(stack)[(default, "interactive")] == (2, False)

    stack.start("worker", "--device", "cpu", "--models", default, wait_for="wt", TIDEPOOL_WORKER_NAME="wt",
                TIDEPOOL_LEASE_SECONDS=4)     # a worker of the default model takes them
    stack.wait(lambda: stack.count(Job.id.in_(t_ids), Job.status == JobStatus.completed) == 2, 120, "tiny jobs")
    got = {j.request["prompt"]: j for j in stack.jobs(Job.id.in_(t_ids))}
    assert [got[f"tiny {i}"].output for i in range(2)] == _expected(stack.model, ["tiny 0", "tiny 1"], 6)
    assert {j.worker for j in got.values()} == {"wt"} and {j.model for j in got.values()} == {default}


def test_a_worker_without_models_serves_every_enabled_model_that_fits(stack, qwen_model, tmp_path):
    from tidepool.workers.tools.tiny_model import make_tiny_model
    from tidepool.workers.model_workers import min_footprint
    default = stack.app.config["TIDEPOOL"].served_model_name
    client = stack.app.test_client()
    big = str(make_tiny_model(str(tmp_path / "big"), seed=2, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=4))
    _register(stack, "qwen", qwen_model)
    _register(stack, "off", qwen_model)
    assert client.patch("/v1/admin/models/off", json={"enabled": False}, headers=ADMIN).status_code == 200
    assert client.post("/v1/admin/models", json={"name": "big", "source": big, "tier": "warm"},
                       headers=ADMIN).status_code == 201
    both = min_footprint(stack.model, "cpu") + min_footprint(qwen_model, "cpu")     # weights and floor KV pools
    budget_mb = both * 1.5 / (1 << 20)
    assert both + min_footprint(big, "cpu") > budget_mb * (1 << 20)   # big does not fit beside the two hot ones
    _, key = stack.tenant()
    proc = stack.start("worker", "--device", "cpu", "--memory-budget-mb", f"{budget_mb:.6f}",
                       wait_for=f"w.{default}", TIDEPOOL_WORKER_NAME="w", TIDEPOOL_LEASE_SECONDS=4)
    stack.wait(lambda: stack.redis.exists(HEARTBEAT_KEY.format("w.qwen")), 60, "w.qwen to start")
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    q_ids = [stack.submit(key, 1, prompt=f"qwen {i}", model="qwen", **body)[0] for i in range(2)]
    t_ids = [stack.submit(key, 1, prompt=f"tiny {i}", **body)[0] for i in range(2)]
    stack.wait(lambda: stack.count(Job.id.in_(q_ids + t_ids), Job.status == JobStatus.completed) == 4, 120,
               "both models' jobs")
    for ids, folder, tag, model in ((q_ids, qwen_model, "qwen", "qwen"), (t_ids, stack.model, "tiny", default)):
        got = {j.request["prompt"]: j for j in stack.jobs(Job.id.in_(ids))}
        assert [got[f"{tag} {i}"].output for i in range(2)] == _expected(folder, [f"{tag} {i}" for i in range(2)], 6)
        assert {j.worker for j in got.values()} == {f"w.{model}"} and {j.model for j in got.values()} == {model}
    lines = [json.loads(ln) for ln in open(proc.log_path) if ln.startswith("{")]
    assert next(rec["models"] for rec in lines if "models" in rec) == [default, "qwen"]     # not off, not big
    skipped = [rec for rec in lines if rec.get("event") == "model.skipped"]
    assert [rec["model"] for rec in skipped] == ["big"] and "do not fit the memory budget" in skipped[0]["msg"]


def test_a_two_model_worker_killed_loses_nothing(stack, qwen_model):
    _register(stack, "qwen", qwen_model)
    default = stack.app.config["TIDEPOOL"].served_model_name
    _, key = stack.tenant()
    stack.start("beat", TIDEPOOL_SWEEP_INTERVAL=1, TIDEPOOL_LEASE_SECONDS=4)
    proc = stack.start("worker", "--device", "cpu", "--models", f"{default},qwen", wait_for="both.qwen",
                       TIDEPOOL_WORKER_NAME="both", TIDEPOOL_LEASE_SECONDS=4)
    body = {"max_tokens": 300, "temperature": 0, "ignore_eos": True, "sla_class": "batch"}
    ids = stack.submit(key, 6, model="qwen", **body) + stack.submit(key, 6, **body)
    stack.wait(lambda: stack.count(Job.id.in_(ids), Job.status == JobStatus.running) >= 2, 60, "jobs running")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stack.start("worker", "--device", "cpu", "--models", f"qwen,{default}", wait_for="again.qwen",
                TIDEPOOL_WORKER_NAME="again", TIDEPOOL_LEASE_SECONDS=4)
    stack.wait(lambda: stack.count(Job.id.in_(ids), Job.status == JobStatus.completed) == len(ids), 300,
               "every job completed after the kill")
    jobs = stack.jobs(Job.id.in_(ids))
    assert all(j.completion_tokens == 300 for j in jobs)
    assert {j.model for j in jobs} == {"qwen", default}
    assert all(j.worker.startswith(("both.", "again.")) for j in jobs)
    assert all(j.worker.endswith("." + j.model) for j in jobs)     # each ran on its own model's engine


def _events(proc, kinds=("model.loaded", "model.unloaded")) -> list[tuple[str, str]]:
    out = []
    for line in open(proc.log_path):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") in kinds:
            out.append((rec["event"].split(".")[1], rec["model"]))
    return out


def test_warm_models_load_on_demand_and_take_turns_under_a_budget_for_one(stack, qwen_model):
    from tidepool.workers.model_workers import min_footprint
    default = stack.app.config["TIDEPOOL"].served_model_name
    _register(stack, "qwen", qwen_model)
    client = stack.app.test_client()
    for name in ("qwen", default):
        assert client.patch(f"/v1/admin/models/{name}", json={"tier": "warm"}, headers=ADMIN).status_code == 200
    least = [min_footprint(f, "cpu") for f in (qwen_model, stack.model)]     # weights and floor KV pools
    budget_mb = max(least) * 1.2 / (1 << 20)
    assert budget_mb * (1 << 20) < sum(least)    # fits only one
    _, key = stack.tenant()
    proc = stack.start("worker", "--device", "cpu", "--models", f"{default},qwen", "--memory-budget-mb",
                       f"{budget_mb:.6f}", TIDEPOOL_WORKER_NAME="host", TIDEPOOL_LOG_LEVEL="INFO",
                       TIDEPOOL_LEASE_SECONDS=4)
    # nothing loaded yet, but the queues view counts both models as served: the host loads them on demand
    stack.wait(lambda: all(served for (m, c), (_, served) in _queues(stack).items() if c == "batch"), 60,
               "the host to advertise its models")
    assert _events(proc) == []
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    done = []
    for turn, (model, prompt) in enumerate((("qwen", "one"), (default, "two"), ("qwen", "three"))):
        ids = [stack.submit(key, 1, prompt=f"{prompt} {i}", model=model, **body)[0] for i in range(3)]
        stack.wait(lambda: stack.count(Job.id.in_(ids), Job.status == JobStatus.completed) == 3, 180,
                   f"turn {turn}: {model}'s jobs")
        done += ids
        folder = qwen_model if model == "qwen" else stack.model
        want = _expected(folder, [f"{prompt} {i}" for i in range(3)], 8)
        got = {j.request["prompt"]: j.output for j in stack.jobs(Job.id.in_(ids))}
        assert [got[f"{prompt} {i}"] for i in range(3)] == want
    assert _events(proc) == [("loaded", "qwen"), ("unloaded", "qwen"), ("loaded", default),
                             ("unloaded", default), ("loaded", "qwen")]
    jobs = stack.jobs(Job.id.in_(done))
    assert len(jobs) == 9 and all(j.status == JobStatus.completed and j.completion_tokens == 8 for j in jobs)

    # cold: its jobs wait until `tidepool models warm` says the workers may load it
    assert client.patch(f"/v1/admin/models/{default}", json={"tier": "cold"}, headers=ADMIN).status_code == 200
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    proc = stack.start("worker", "--device", "cpu", "--models", f"{default},qwen", "--memory-budget-mb",
                       f"{budget_mb:.6f}", TIDEPOOL_WORKER_NAME="host2", TIDEPOOL_LOG_LEVEL="INFO")
    ids = stack.submit(key, 2, prompt="cold", **body)
    import time
    time.sleep(4)
    assert stack.count(Job.id.in_(ids), Job.status == JobStatus.queued) == 2 and _events(proc) == []
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tidepool.workers.cli", "models", "warm", default], env=stack.env(),
                         cwd=stack.tmp, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    stack.wait(lambda: stack.count(Job.id.in_(ids), Job.status == JobStatus.completed) == 2, 180, "cold jobs")
    assert _events(proc) == [("loaded", default)]
    import urllib.request
    port = next(json.loads(ln)["metrics_port"] for ln in open(proc.log_path) if ln.startswith('{"models"'))
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'tidepool:model_loaded{{model="{default}"}} 1.0' in page
    assert 'tidepool:model_loaded{model="qwen"} 0.0' in page
    assert f'tidepool:model_load_seconds_count{{model="{default}"}} 1.0' in page
