"""`tidepool serve` with two models in TIDEPOOL_MODELS_DIR: the first start registers both (the
default one hot, the other warm), /v1/models lists both, each answers with its own weights, and the admin queues
view shows a live worker for each."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import requests

from tidepool.workers.engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_serve_registers_and_serves_every_model_in_the_models_dir(tmp_path):
    from tidepool.workers.tools.tiny_model import make_tiny_model
    models = tmp_path / "models"
    tiny = str(make_tiny_model(str(models / "tiny"), seed=1))
    other = str(make_tiny_model(str(models / "tiny-qwen"), arch="qwen2", seed=7, hidden_size=96,
                                num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(TIDEPOOL_MODEL=tiny, TIDEPOOL_MODELS_DIR=str(models), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "serve", "--port", str(port)], cwd=tmp_path,
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while not (key := re.search(r"API key:\s+(\S+)", log.read_text())) and time.monotonic() < end:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert key, log.read_text()
        base = f"http://127.0.0.1:{port}"
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key=key.group(1), max_retries=0, timeout=120)
        assert sorted(m.id for m in oa.models.list().data) == ["tiny", "tiny-qwen"]
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        for name, folder in (("tiny", tiny), ("tiny-qwen", other)):
            r = oa.completions.create(model=name, prompt="Hello", max_tokens=5, temperature=0, extra_body={
                "ignore_eos": True})
            assert r.model == name and r.choices[0].text == LLM(folder, device="cpu").generate(["Hello"], params)[0].text
        admin = (tmp_path / "var" / "admin_token").read_text().strip()
        listing = requests.get(f"{base}/v1/admin/models", headers={"Authorization": f"Bearer {admin}"}).json()
        assert {(m["id"], m["tier"], m["registered"]) for m in listing["data"]} == {("tiny", "hot", True),
                                                                                   ("tiny-qwen", "warm", True)}
        rows = requests.get(f"{base}/v1/admin/queues", headers={"Authorization": f"Bearer {admin}"}).json()["models"]
        assert all(r["served"] for r in rows if r["sla_class"] == "interactive")
        text = log.read_text()      # no GPU: one engine per model, named for the device, no cpu-deferrable worker
        assert "for the embedded-cpu worker" in text and "for the embedded-cpu.tiny-qwen worker" in text
        assert "deferrable" not in re.sub(r"queues[^\n]*", "", text)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
