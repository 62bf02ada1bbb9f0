"""The thread that builds an engine gives its OpenMP team back, so the worker thread stepping the engine holds the
only team (workers/engine/openmp.py). Run in a fresh interpreter: the team threads are counted in /proc."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, sys, threading
import torch
from tidepool.workers.engine.openmp import release_team

def threads():
    return len(os.listdir("/proc/self/task"))

out = {"start": threads()}
torch.randn(400_000).exp_()                 # a parallel region on the main thread: its team starts
out["after_region"] = threads()
out["released"] = release_team()
out["after_release"] = threads()
if sys.argv[1:]:
    from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
    torch.randn(400_000).exp_()
    engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", num_kv_blocks=64))
    out["after_engine"] = threads()

    def step():
        engine.add_request("a", list(range(5, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        out["while_stepping_on_a_thread"] = threads()
    t = threading.Thread(target=step)
    t.start()
    t.join()
print(json.dumps(out))
"""


def _run(*args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def counts(tiny_model_dir):
    return _run(tiny_model_dir())


def test_release_team_ends_the_calling_threads_team(counts):
    assert counts["released"] is True
    assert counts["after_region"] == counts["start"] + 1      # main plus one team thread (two OpenMP threads)
    assert counts["after_release"] == counts["start"]


def test_an_engine_built_on_this_thread_leaves_it_without_a_team(counts):
    assert counts["after_engine"] == counts["start"]
    # the stepping thread and its one team thread: the only team in the process
    assert counts["while_stepping_on_a_thread"] == counts["start"] + 2
