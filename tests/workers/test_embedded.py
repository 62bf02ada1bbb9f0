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

ROOT = Path(__file__).resolve().parents[2]


def test_serve_answers_with_no_redis(tiny_model, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(TIDEPOOL_MODEL=tiny_model, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "serve", "--port", str(port)], cwd=tmp_path,
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 60
        while not (key := re.search(r"API key:\s+(\S+)", log.read_text())) and time.monotonic() < end:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert key, log.read_text()
        text = log.read_text()
        assert f"http://127.0.0.1:{port}/admin" in text and "curl " in text and "from openai import OpenAI" in text
        assert (tmp_path / "var" / "tidepool.db").is_file()

        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key.group(1), max_retries=0, timeout=60)
        r = oa.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        chunks = list(oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
        assert chunks[-1].usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
