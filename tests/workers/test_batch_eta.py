"""Deadlines and ETAs for offline work through the unmodified `openai` client: an in-progress batch carries
`x_tidepool` (eta, position, remaining, at_risk) that the SDK parses as extra fields, present and moving forward as
the batch drains; a batch that will miss its window is flagged on /metrics and in the panel before it expires; at
expiry its completed lines are delivered and the rest reported expired, as OpenAI does."""
import json
import re
import time
from datetime import timedelta

import openai
import pytest
import requests
from sqlalchemy import update
from sqlalchemy.orm import Session

from tidepool.service.ledger.models import Batch, Job, JobStatus, utcnow

from .conftest import Stack, flush_redis

WORKER = "eta-gpu"


@pytest.fixture(scope="module")
def st(pg_databases, tiny_model, tmp_path_factory, redis_url):
    flush_redis(redis_url)
    url = pg_databases.create()
    tmp = tmp_path_factory.mktemp("eta")
    stack = Stack(url, tiny_model, tmp, redis_url)
    stack.serve()
    stack.worker(WORKER, TIDEPOOL_MAX_NUM_SEQS=2, TIDEPOOL_LOW_WATER=1)     # a slow drain, to watch
    stack.start("beat", TIDEPOOL_SWEEP_INTERVAL=0.5, TIDEPOOL_BEAT_SCHEDULE=tmp / "beat-schedule")
    yield stack
    stack.close()
    flush_redis(redis_url)
    pg_databases.drop(url)


def _batch(st, oa, n: int, max_tokens: int):
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"Line {i}.", "max_tokens": max_tokens, "ignore_eos": True}})
             for i in range(n)]
    f = oa.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    return oa.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")


def test_eta_is_present_and_moves_forward_as_a_batch_drains(st):
    _, key = st.tenant()
    oa = openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=60)
    b = _batch(st, oa, 24, 24)
    seen = []
    while True:
        x = oa.batches.retrieve(b.id)
        extra = x.x_tidepool             # an extra field of the SDK's Batch model
        if x.status != "in_progress":
            break
        seen.append((time.time(), extra["remaining"], extra["eta"], extra["at_risk"]))
        time.sleep(0.2)
    assert x.status == "completed" and x.request_counts.completed == 24
    assert x.x_tidepool["eta"] is None and x.x_tidepool["remaining"] == 0
    remaining = [r for _, r, _, _ in seen]
    assert remaining == sorted(remaining, reverse=True) and remaining[0] > remaining[-1], remaining
    timed = [(at, r, eta) for at, r, eta, _ in seen if eta is not None]
    assert len(timed) >= 3, seen                        # an estimate as soon as the class has a drain rate
    assert not any(risk for *_, risk in seen)           # a 24 h window is far away
    left = [eta - at for at, _, eta in timed]
    # the time left shrinks as the batch drains (each estimate within a second or so of the drain so far)
    assert left[-1] < left[0] and all(b <= a + 2.0 for a, b in zip(left, left[1:])), left


def test_a_batch_that_will_miss_its_window_is_flagged_then_expires_with_partial_output(st):
    _, key = st.tenant()
    oa = openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=60)
    b = _batch(st, oa, 80, 64)
    st.wait(lambda: oa.batches.retrieve(b.id).request_counts.completed >= 4, 60, "some lines done")
    # its window is about to close (the API takes only 24h windows: the ledger's clock is moved instead)
    with Session(st.engine) as s:
        s.execute(update(Batch).where(Batch.id == b.id).values(expires_at=utcnow() + timedelta(seconds=1.5)))
        s.commit()
    x = oa.batches.retrieve(b.id)
    assert x.status == "in_progress" and x.x_tidepool["at_risk"], x.x_tidepool
    scrape = requests.get(f"{st.url}/metrics", timeout=10, headers={"Authorization": "Bearer admin"}).text
    assert 'tidepool:batches_at_risk{sla_class="batch"} 1.0' in scrape     # (no tenant ids unless opted in)
    panel = st.app.test_client()
    login = panel.get("/admin/login", base_url="https://localhost").text
    panel.post("/admin/login", base_url="https://localhost", data={
        "token": "admin", "csrf_token": re.search(r'name="csrf_token" value="([^"]+)"', login).group(1)})
    page = panel.get(f"/admin/batches/{b.id}", base_url="https://localhost")
    assert page.status_code == 200 and "will miss its window" in page.text
    with Session(st.engine) as s:      # ... and closes now, with most of the batch still queued
        s.execute(update(Batch).where(Batch.id == b.id).values(expires_at=utcnow()))
        s.commit()
    done = st.wait(lambda: (y := oa.batches.retrieve(b.id)).status in ("expired", "completed") and y, 60,
                   "the batch expired")
    assert done.status == "expired" and done.expired_at
    out = [json.loads(line) for line in oa.files.content(done.output_file_id).text.splitlines()]
    err = [json.loads(line) for line in oa.files.content(done.error_file_id).text.splitlines()]
    assert len(out) >= 4 and len(out) + len(err) == 80 and err
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    assert {r["error"]["code"] for r in err} == {"batch_expired"} and all(r["response"] is None for r in err)
    assert done.request_counts.completed == len(out) and done.request_counts.failed == len(err)
    assert st.count(Job.batch_id == b.id, Job.status == JobStatus.completed) == len(out)
