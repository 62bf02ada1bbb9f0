"""Where a benchmark's result goes: `benchmarks/results/<name>.json`, one JSON line holding the result and what it
was measured on (the machine's CPU model, cores and the flags that matter, the GPU if any, torch's version, the git
commit and the date), so a figure on the benchmarks page always names its machine and date.

Each benchmark script calls `record(name, result)` once, after printing its own output; `benchmarks/report.py`
renders docs/benchmarks.md from these files. TIDEPOOL_BENCH_RESULTS points the files at another folder (tests).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")   # the flags the CPU kernels choose by


def results_dir() -> Path:
    return Path(os.environ.get("TIDEPOOL_BENCH_RESULTS") or RESULTS)


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """The CPU (lscpu's model name, cores, the flags that matter), the GPU (nvidia-smi's name) and the OS kernel."""
    lscpu = dict(re.findall(r"^([^:\n]+):\s*(.*)$", _run(["lscpu"]), re.M))
    flags = set(lscpu.get("Flags", "").split())
    if not flags and Path("/proc/cpuinfo").is_file():
        found = re.search(r"^flags\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
        flags = set(found.group(1).split()) if found else set()
    cores = lscpu.get("Core(s) per socket"), lscpu.get("Socket(s)")
    gpu = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).splitlines()
    return {"cpu": lscpu.get("Model name", "unknown"),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cores": int(cores[0]) * int(cores[1]) if all(c and c.isdigit() for c in cores) else None,
            "flags": [f for f in CPU_FLAGS if f in flags],
            "gpu": gpu[0] if gpu else None,
            "kernel": os.uname().release}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def record(name: str, result, argv: list[str] | None = None) -> Path:
    """Write `result` (a JSON-able dict or list) as benchmarks/results/<name>.json with the command that produced
    it, the machine, torch's version, the commit and the date; returns the file."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve() if argv else None
    shown = str(script.relative_to(ROOT)) if script and script.is_relative_to(ROOT) else (argv[0] if argv else "")
    commit = _run(["git", "rev-parse", "--short=12", "HEAD"]) or None
    # the code differs from the commit; recorded results (a benchmark that records after each part) do not count
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                       ":(exclude)benchmarks/results"])) if commit else None
    line = {"name": name, "command": shlex.join(["python", shown, *argv[1:]]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit, "dirty": dirty, "machine": machine(), "torch": _version("torch"),
            "result": result}
    folder = results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(line) + "\n")
    return path


def load(folder: Path | None = None) -> dict[str, dict]:
    """Every recorded result, by name."""
    folder = folder or results_dir()
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}
