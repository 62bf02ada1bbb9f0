"""benchmarks/load.py's verdict, from fabricated client records and ledger rows (the load itself never runs here):
each check catches what it exists for, and a clean run passes."""
import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "load.py"
_spec = importlib.util.spec_from_file_location("load_bench", _path)
load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load)

FAULTS = [{"kind": "redis_restart", "start": 100.0, "end": 104.0}]


def rec(kind, status, t0=10.0, t1=10.05, **extra):
    return {"kind": kind, "status": status, "t0": t0, "t1": t1, "ms": (t1 - t0) * 1000, "retry_after": None, **extra}


def job(id_, tenant="t1", status="completed", p=5, c=8, **extra):
    return {"id": id_, "tenant_id": tenant, "status": status, "attempts": 1, "prompt_tokens": p,
            "completion_tokens": c, "error": None, "output": f"out {id_}", "batch_id": None, **extra}


def clean():
    jobs = [job("job_a"), job("job_b", tenant="t2", c=16), job("job_c", batch_id="batch_1"),
            job("job_d", status="failed", p=None, c=None, error={"code": "lease_expired"})]
    usage = [{"tenant_id": "t1", "requests": 2, "prompt_tokens": 10, "completion_tokens": 16},
             {"tenant_id": "t2", "requests": 1, "prompt_tokens": 5, "completion_tokens": 16}]
    counters = [{"tenant_id": t, "queued_count": 0, "running_count": 0, "budget_reserved": 0} for t in ("t1", "t2")]
    batches = [{"id": "batch_1", "status": "completed", "total": 1, "completed": 1, "failed": 0}]
    delivered = [{"id": "job_b", "text": "out job_b"}]
    return dict(jobs=jobs, usage=usage, counters=counters, batches=batches, accepted={"job_a", "job_b", "job_d"},
                accepted_batches={"batch_1": 1}, delivered=delivered, idempotency_mismatch=0)


def test_a_clean_ledger_passes():
    out = load.ledger_checks(**clean())
    assert (out["jobs_lost"], out["jobs_run_twice"], out["billing_mismatch"], out["counters_leaked"],
            out["batches_short"]) == (0, 0, 0, 0, 0)
    assert (out["jobs_accepted"], out["tokens_generated"], out["tokens_billed"]) == (4, 32, 32)


@pytest.mark.parametrize("break_it, field", [
    (lambda d: d["jobs"].__setitem__(0, job("job_a", status="running", c=None, p=None)), "jobs_lost"),
    (lambda d: d["accepted"].add("job_never_written"), "jobs_lost"),
    (lambda d: d["jobs"][3].__setitem__("error", None), "jobs_lost"),          # failed without a reason
    (lambda d: d["usage"][1].__setitem__("requests", 2), "jobs_run_twice"),   # billed twice
    (lambda d: d["delivered"].append({"id": "job_a", "text": "out job_aout job_a"}), "jobs_run_twice"),
    (lambda d: d.__setitem__("idempotency_mismatch", 1), "jobs_run_twice"),
    (lambda d: d["usage"][0].__setitem__("completion_tokens", 8), "billing_mismatch"),   # a job unbilled
    (lambda d: d["jobs"].append(job("job_e", status="cancelled", c=4)), "billing_mismatch"),
    (lambda d: d.__setitem__("cut", [{"id": "job_e", "tokens": 0}]) or d["jobs"].append(
        job("job_e", status="cancelled", c=None, p=None)), "cut_unbilled"),     # a cancelled running job unbilled
    (lambda d: d.__setitem__("cut", [{"id": "job_b", "tokens": 99}]), "cut_unbilled"),   # billed less than sent
    (lambda d: d["counters"][0].__setitem__("budget_reserved", 12), "counters_leaked"),
    (lambda d: d["batches"][0].__setitem__("status", "in_progress"), "batches_short"),
    (lambda d: d["accepted_batches"].__setitem__("batch_1", 3), "batches_short"),
])
def test_each_ledger_check_catches_its_fault(break_it, field):
    data = clean()
    break_it(data)
    assert load.ledger_checks(**data)[field] > 0


def test_503s_need_retry_after_and_a_fault_window():
    records = [rec("job", 202, ms=20), rec("job", 202),
               rec("job", 503, 101.0, 101.1, retry_after="5"),          # inside the restart
               rec("stream", 503, 90.0, 112.0, retry_after="5"),        # sent before, answered within the grace
               rec("job", 503, 101.0, 101.1),                           # no Retry-After
               rec("upload", 503, 130.0, 130.1, retry_after="5"),       # long after the recovery
               rec("stream", 200, ttft_ms=150.0, error_code="stream_failed"),
               rec("completion", 500), rec("completion", 0), rec("batch", 504)]
    out = load.client_checks(records, FAULTS, grace=10.0)
    assert out["unexplained_503"] == 2
    assert out["errors_500"] == 2 and out["errors_5xx_other"] == 1 and out["connection_errors"] == 1
    assert out["status_counts"]["503"] == 4 and out["by_kind"]["job"] == {"202": 2, "503": 2}
    assert out["admission_n"] == 2 and out["ttft_p50_ms"] == 150.0


def test_verdict_and_arguments():
    good = {"admission_p99_ms": 40.0, "drained": True}
    assert load.verdict(good, 100.0) == []
    assert load.verdict({**good, "admission_p99_ms": 140.0, "jobs_lost": 1}, 100.0) == ["jobs_lost", "admission_p99_ms"]
    assert load.verdict({**good, "drained": False}, 100.0) == ["drained"]
    args = load.parse_args(["--duration", "90", "--tenants", "10", "--mix", "stream=1,job=2"])
    assert (args.duration, args.tenants, args.weights) == (90.0, 10, {"stream": 1, "job": 2})
    assert load.parse_args([]).duration == 600 and load.parse_args([]).tenants == 50
    with pytest.raises(Exception):
        load.parse_args(["--mix", "fuzz=3"])
    assert load.procfile_web(8123)[-3:] == ["--bind", "0.0.0.0:8123", "tidepool.service.wsgi:app"]


def test_figures_outside_faults_leave_out_what_overlapped_one():
    records = [rec("job", 202, t0=float(i), t1=i + 0.02) for i in range(20)] + \
              [rec("batch", 200, 101.0, 101.9), rec("stream", 200, 50.0, 120.0, ttft_ms=60000.0),
               rec("stream", 200, 10.0, 11.0, ttft_ms=300.0)]
    out = load.client_checks(records, FAULTS, grace=10.0)
    assert out["admission_n"] == 21 and out["admission_max_ms"] == 900.0
    assert out["admission_p99_ms_outside_faults"] == 20.0
    assert (out["ttft_p99_ms_outside_faults"], out["ttft_n"]) == (300.0, 2)
