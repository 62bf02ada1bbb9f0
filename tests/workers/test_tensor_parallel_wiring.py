"""tensor_parallel_size outside the engine: a registered model's own size reaches its worker's EngineConfig over the
deployment's (variable, flag); a worker counts a model's ranks against its memory budget and leaves out a model
whose largest rank does not fit one device; worker, serve and run-batch refuse such a model in one line that
names the size that fits. No rank starts here: the fit check reads config.json only (device_memory_gib makes the
device small)."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tidepool.service.ledger.registry import Entry
from tidepool.workers.engine.models.sharding import largest_rank_weight_bytes
from tidepool.workers.model_workers import (block_bytes, engine_config, fitting_models, folder_bytes, model_configs,
                                            ranks_held, weight_bytes)

ROOT = Path(__file__).resolve().parents[2]
TOO_SMALL_FOR_ONE_RANK = 0.001     # GiB: the tiny model needs more at tensor_parallel_size=1, less at 2
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor_parallel_size 2 needs 2 CPU cores")


def _entry(name, folder, size=None) -> Entry:
    return Entry(name, folder, "hot", True, 0, True, size)


def test_a_models_own_size_wins_over_the_deployments(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", f"sqlite:///{tmp_path / 't.db'}")
    monkeypatch.setenv("TIDEPOOL_MODEL", tiny_model)
    monkeypatch.setenv("TIDEPOOL_TENSOR_PARALLEL_SIZE", "3")
    from tidepool.service.ledger.settings import Config
    settings = Config.from_env()
    entries = {"own": _entry("own", tiny_model, 2), "plain": _entry("plain", tiny_model)}
    cfgs = model_configs(["own", "plain"], settings, "cpu", "cpu", entries=entries)
    assert [c.engine["tensor_parallel_size"] for c in cfgs] == [2, 3]          # its own, else the variable
    cfgs = model_configs(["own", "plain"], settings, "cpu", "cpu", {"tensor_parallel_size": 4}, entries=entries)
    assert [c.engine["tensor_parallel_size"] for c in cfgs] == [2, 4]          # its own, else the flag


@TWO_CORES
def test_the_budget_counts_every_rank_on_the_cpu_and_rank_0_on_a_gpu(tiny_model):
    one, two = engine_config(tiny_model, "cpu"), engine_config(tiny_model, "cpu", {"tensor_parallel_size": 2})
    m = two.model_config
    assert (ranks_held(one), ranks_held(two)) == (1, 2)
    assert weight_bytes(tiny_model, one) == folder_bytes(tiny_model)
    assert weight_bytes(tiny_model, two) == \
        folder_bytes(tiny_model) * 2 * largest_rank_weight_bytes(m, 2, 1) // largest_rank_weight_bytes(m, 1, 1)
    assert block_bytes(one) == one.kv_block_bytes and block_bytes(two) == 2 * two.kv_block_bytes
    on_gpu = SimpleNamespace(device="cuda", tensor_parallel_size=2, model_config=m, kv_block_bytes=two.kv_block_bytes)
    assert ranks_held(on_gpu) == 1 and block_bytes(on_gpu) == two.kv_block_bytes
    assert weight_bytes(tiny_model, on_gpu) < folder_bytes(tiny_model) < weight_bytes(tiny_model, two)


@TWO_CORES
def test_a_model_too_large_for_one_device_is_left_out_unless_it_is_split(tiny_model, caplog):
    entries = {"whole": _entry("whole", tiny_model), "split": _entry("split", tiny_model, 2)}
    small = {"device_memory_gib": TOO_SMALL_FOR_ONE_RANK}
    assert fitting_models(entries, None, 1 << 40, engine_overrides=small) == ["split"]
    skipped = [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "model.skipped"]
    assert len(skipped) == 1 and skipped[0].startswith("model whole is not served:")
    assert "tensor_parallel_size=2 fits" in skipped[0]


def _cli(tmp_path, *args, **env):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TIDEPOOL_LOG_LEVEL="WARNING", **env)
    return subprocess.run([sys.executable, "-m", "tidepool.workers.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", [["worker", "--kind", "cpu", "--device", "cpu"], ["serve", "--device", "cpu"],
                                     ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--device", "cpu"]])
def test_a_command_refuses_a_model_that_does_not_fit_in_one_line(tmp_path, tiny_model, command):
    (tmp_path / "in.jsonl").write_text("")
    done = _cli(tmp_path, *command, TIDEPOOL_MODEL=tiny_model, TIDEPOOL_DATABASE_URL=f"sqlite:///{tmp_path / 't.db'}",
                TIDEPOOL_DEVICE_MEMORY_GIB=str(TOO_SMALL_FOR_ONE_RANK))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tidepool {command[0]}: model {tiny_model} needs ")
    assert "at tensor_parallel_size=1" in last and "tensor_parallel_size=2 fits" in last


def test_the_registered_default_models_own_size_reaches_the_worker(tmp_path, tiny_model):
    env = {"TIDEPOOL_MODEL": tiny_model, "TIDEPOOL_DATABASE_URL": f"sqlite:///{tmp_path / 't.db'}"}
    name = Path(tiny_model).name
    assert _cli(tmp_path, "db", "upgrade", **env).returncode == 0
    done = _cli(tmp_path, "models", "register", name, tiny_model, "--tensor-parallel-size", "2", **env)
    assert json.loads(done.stdout)["tensor_parallel_size"] == 2, done.stderr
    done = _cli(tmp_path, "worker", "--kind", "cpu", "--device", "cpu", **env, TIDEPOOL_DEVICE_MEMORY_GIB="0.0001")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "at tensor_parallel_size=2" in done.stderr.strip().splitlines()[-1]     # refused before any rank starts
