"""`tidepool serve` with no Redis and no database configured: SQLite, the in-process transport and
worker threads answer through the same API."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]


ADMIN = "embedded-admin"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """`tidepool serve` on pure defaults (the admin token aside): the base URL, the printed API key, the folder."""
    tmp = tmp_path_factory.mktemp("serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(TIDEPOOL_MODEL=tiny_model, TIDEPOOL_ADMIN_TOKEN=ADMIN, TIDEPOOL_MAX_LORAS="1", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1")
    log = tmp / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "serve", "--port", str(port)], cwd=tmp,
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 60
        while not (key := re.search(r"API key:\s+(\S+)", log.read_text())) and time.monotonic() < end:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert key, log.read_text()
        yield f"http://127.0.0.1:{port}", key.group(1), tmp, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_answers_with_no_redis(served):
    url, key, tmp, log = served
    text = log.read_text()
    assert f"{url}/admin" in text and "curl " in text and "from openai import OpenAI" in text
    assert (tmp / "var" / "tidepool.db").is_file()

    oa = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    r = oa.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    chunks = list(oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, stream=True))
    assert chunks[-1].usage.completion_tokens == 4


def _lora_folder(model_dir: str, path: Path) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                    init_lora_weights=False)).save_pretrained(path)
    return str(path)


def test_requests_that_read_before_they_write_are_served_on_sqlite(served, tiny_model):
    """An Idempotency-Key, a previous_response_id and a LoRA adapter are each read before admission writes the job:
    on SQLite those reads take no write lock, so none of these waits out the lock timeout (503)."""
    url, key, tmp, _ = served
    fast = dict(max_retries=0, timeout=15)
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "embedded-1"}
    first = requests.post(f"{url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 2}, headers=headers, timeout=15)
    again = requests.post(f"{url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 2}, headers=headers, timeout=15)
    assert (first.status_code, again.status_code) == (202, 200), (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]

    oa = openai.OpenAI(base_url=f"{url}/v1", api_key=key, **fast)
    r = oa.responses.create(model="tiny", input="Hello", max_output_tokens=3, temperature=0)
    follow = oa.responses.create(model="tiny", input="And then?", previous_response_id=r.id, max_output_tokens=3,
                                 temperature=0)
    assert follow.previous_response_id == r.id and follow.usage.output_tokens == 3

    admin = {"Authorization": f"Bearer {ADMIN}"}
    reg = requests.post(f"{url}/v1/admin/adapters", headers=admin, timeout=15, json={
        "name": "embedded-qv", "base_model": "tiny", "source": _lora_folder(tiny_model, tmp / "lora")})
    assert reg.status_code == 201, reg.text
    for _ in range(3):
        out = oa.completions.create(model="embedded-qv", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
