"""Embeddings end to end through `tidepool serve` and the official `openai` client: online in float
and base64, token-id inputs, the same body in /v1/jobs and in a Batch file, each vector equal to the engine's own;
a model asked for what it does not serve and bad input are 400s naming the field."""
import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from tidepool.workers.engine import LLM

ROOT = Path(__file__).resolve().parents[2]
MODEL = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm_dir):
    from tidepool.workers.tools.tiny_model import make_tiny_model
    tmp = tmp_path_factory.mktemp("serve")
    models = tmp / "models"
    tiny = str(make_tiny_model(str(models / "tiny"), seed=1))
    os.symlink(minilm_dir, models / MODEL)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(TIDEPOOL_MODEL=tiny, TIDEPOOL_MODELS_DIR=str(models), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log = tmp / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "serve", "--port", str(port)], cwd=tmp,
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while not (key := re.search(r"API key:\s+(\S+)", log.read_text())) and time.monotonic() < end:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert key, log.read_text()
        base = f"http://127.0.0.1:{port}"
        yield base, key.group(1), openai.OpenAI(base_url=f"{base}/v1", api_key=key.group(1), max_retries=0,
                                                timeout=120)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def engine(minilm_dir):
    return LLM(minilm_dir, calibrate=False)


def assert_same(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.99999, cos


def test_online_float_base64_and_token_ids(served, engine):
    _, _, oa = served
    texts = ["The tide comes in.", "Ünïcödé 🚀", "a"]
    want = engine.embed(texts)
    r = oa.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    assert_same([d.embedding for d in r.data], want)
    ids = [engine.tokenizer.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    b64 = oa.embeddings.create(model=MODEL, input=texts[0], encoding_format="base64")
    assert_same(np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype=np.float32), want[:1])
    default = oa.embeddings.create(model=MODEL, input=texts[1])      # the SDK asks for base64 and decodes it
    assert_same(default.data[0].embedding, want[1:2])
    assert_same([d.embedding for d in oa.embeddings.create(model=MODEL, input=ids, encoding_format="float").data],
                want)
    one = oa.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[0])
    long = oa.embeddings.create(model=MODEL, input="word " * 400, encoding_format="float", extra_body={"truncate": True})
    assert long.usage.prompt_tokens == 256


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "input": []}, "input"),
    ({"model": MODEL, "input": [""]}, "input[0]"),
    ({"model": MODEL, "input": ["a", 5]}, "input[1]"),
    ({"model": MODEL, "input": [[1, 2], []]}, "input[1]"),
    ({"model": MODEL, "input": ["x"] * 2049}, "input"),
    ({"model": MODEL, "input": 7}, "input"),
    ({"model": MODEL}, "input"),
    ({"model": MODEL, "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"model": MODEL, "input": "x", "dimensions": 64}, "dimensions"),
    ({"model": MODEL, "input": "x", "temperature": 1}, "temperature"),
    ({"model": MODEL, "input": "word " * 400}, "input"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(served, body, param):
    base, key, _ = served
    r = requests.post(f"{base}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_embedding_model_does_not_generate_nor_a_generating_model_embed(served):
    """As OpenAI: no such model for this endpoint, a 404 naming `model`."""
    _, _, oa = served
    with pytest.raises(openai.NotFoundError) as err:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as err:
        oa.embeddings.create(model="tiny", input="x")
    assert err.value.body["param"] == "model"


def test_native_job_and_batch_file(served, engine):
    base, key, oa = served
    headers = {"Authorization": f"Bearer {key}"}
    job = requests.post(f"{base}/v1/jobs", headers=headers, json={"model": MODEL, "input": ["tide", "pool"],
                                                                  "sla_class": "batch"}).json()
    texts = [f"sentence number {i} about the sea" for i in range(12)]
    lines = [json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": MODEL, "input": texts[i:i + 3], "encoding_format": "float"}})
             for i in range(0, 12, 3)]
    f = oa.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = oa.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    end = time.monotonic() + 180
    while (batch := oa.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired") \
            and time.monotonic() < end:
        time.sleep(0.5)
    assert batch.status == "completed", batch
    out = [json.loads(line) for line in oa.files.content(batch.output_file_id).text.splitlines()]
    got = {o["custom_id"]: o["response"]["body"] for o in out}
    assert sorted(got) == [f"e{i}" for i in range(0, 12, 3)]
    vectors = [d["embedding"] for i in range(0, 12, 3) for d in got[f"e{i}"]["data"]]
    assert_same(vectors, engine.embed(texts))
    assert all(b["object"] == "list" and b["usage"]["prompt_tokens"] > 0 for b in got.values())

    while (done := requests.get(f"{base}/v1/jobs/{job['id']}", headers=headers).json())["status"] != "completed":
        assert done["status"] in ("queued", "running"), done
        time.sleep(0.2)
    assert_same([d["embedding"] for d in done["output"]["data"]], engine.embed(["tide", "pool"]))
    assert done["usage"]["prompt_tokens"] == done["usage"]["total_tokens"] > 0
