"""What an engine does and says at start-up: a KV pool sized to what max_num_seqs x max_model_len can use (capped
by a share of available memory), reported in a log line; the native CPU kernel loaded from the cache before the first
request, or, not built yet, built in the background while the torch path serves (the build line only then);
run-batch, serve and worker take the same engine flags."""
import json
import logging
import threading

import pytest

from tidepool.kernels import cpu_ops
from tidepool.workers.cli import main
from tidepool.workers.engine import (
    LLM,
    EngineConfig,
    LLMEngine,
    SamplingParams,
    host_pools,
    model_runner,
)


def _pool_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]


@pytest.fixture
def quiet_host(monkeypatch, tmp_path):
    """No other KV pool on this host: an empty host_pools folder, none held in this process."""
    monkeypatch.setattr(host_pools, "folder", lambda: tmp_path / "pools")
    monkeypatch.setattr(host_pools, "_held", {})


def test_pool_is_what_the_sequences_can_use(tiny_model_dir, caplog, quiet_host):
    caplog.set_level(logging.INFO)
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=4, max_model_len=64))
    assert engine.runner.num_kv_blocks == 4 * 64 // 16
    assert _pool_lines(caplog) == ["KV pool: 16 blocks of 16 tokens = 256 tokens, 0 MiB, float32 (max_num_seqs x "
                                   "max_model_len; max_num_seqs 4, max_model_len 64)"]


def test_pool_is_capped_by_available_memory(tiny_model_dir, caplog, monkeypatch, quiet_host):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(model_runner, "available_memory", lambda: 40 * 2**20)
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=256))
    budget = int(40 * 2**20 * model_runner.CPU_KV_SHARE)
    assert engine.runner.num_kv_blocks == budget // engine.runner.bytes_per_block
    assert f"({model_runner.CPU_KV_SHARE:.0%} of available memory;" in _pool_lines(caplog)[0]


@pytest.fixture
def unbuilt_kernel(monkeypatch):
    """The native library as on a machine that never built it: not loaded in this process, not in the cache; its
    build (the cached library, built for real first) waits for the test's gate. Restored after the test."""
    if cpu_ops.compiler() is None or not cpu_ops.enabled():
        pytest.skip("no C++ compiler, or the native kernels are switched off")
    assert cpu_ops.paged_decode_op() is not None, cpu_ops.unavailable_reason()
    real_build, gate, builds = cpu_ops._build, threading.Event(), []

    def build(cxx, cached_only=False, nice=0):
        if cached_only:
            return None
        builds.append(nice)
        assert gate.wait(60)
        return real_build(cxx)

    for name, value in (("_tried", False), ("_op", None), ("_why_not", None), ("_building", None),
                        ("_build", build), ("_loaded", lambda: False)):
        monkeypatch.setattr(cpu_ops, name, value)
    yield gate, builds
    gate.set()
    if cpu_ops._building is not None:
        cpu_ops._building.join(60)


def _runner_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name in ("tidepool.workers.engine.model_runner", "tidepool.kernels.cpu_ops")]


def test_a_first_build_runs_in_the_background_while_the_torch_path_serves(tiny_model_dir, caplog, unbuilt_kernel):
    gate, builds = unbuilt_kernel
    caplog.set_level(logging.INFO)
    llm = LLM(tiny_model_dir("llama-gqa"), max_num_seqs=2, max_model_len=64)      # does not wait for the build
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    said = _runner_lines(caplog)
    assert [m for m in said if "kernel" in m] == [(
        "native CPU decode kernel: not built on this machine yet; building it in the background (20-50 s of one "
        "core, once), decode uses the torch path until it is ready")], said
    assert builds == [10]                              # the compiler runs niced, beside the engine
    assert cpu_ops.prepare(background=True) == "building" and cpu_ops.paged_decode_op(wait=False) is None
    torch_path = [o.token_ids for o in llm.generate(["hello there", [5, 6, 7]], params)]
    gate.set()
    cpu_ops._building.join(60)
    assert cpu_ops.paged_decode_op(wait=False) is not None
    assert [o.token_ids for o in llm.generate(["hello there", [5, 6, 7]], params)] == torch_path
    ready = [m for m in _runner_lines(caplog) if m.startswith("native CPU decode kernel ready")]
    assert len(ready) == 1 and ready[0].startswith("native CPU decode kernel ready: built in the background in ")


def test_a_cached_kernel_loads_at_start_without_a_build_line(tiny_model_dir, caplog, monkeypatch):
    if cpu_ops.compiler() is None or not cpu_ops.enabled():
        pytest.skip("no C++ compiler, or the native kernels are switched off")
    assert cpu_ops.paged_decode_op() is not None, cpu_ops.unavailable_reason()     # built: in the cache now
    for name, value in (("_tried", False), ("_op", None), ("_building", None), ("_loaded", lambda: False)):
        monkeypatch.setattr(cpu_ops, name, value)
    caplog.set_level(logging.INFO)
    LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=2, max_model_len=32))
    said = [m for m in _runner_lines(caplog) if "kernel" in m or m.startswith("built ")]
    assert len(said) == 1 and said[0].startswith("native CPU decode kernel ready in "), said
    assert cpu_ops._building is None and cpu_ops.paged_decode_op(wait=False) is not None


@pytest.mark.parametrize("env", [False, True])
def test_run_batch_takes_the_engine_flags(tiny_model_dir, tmp_path, caplog, capsys, monkeypatch, env):
    caplog.set_level(logging.INFO)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "hi", "max_tokens": 3}}) + "\n")
    if env:
        monkeypatch.setenv("TIDEPOOL_NUM_KV_BLOCKS", "9")
        monkeypatch.setenv("TIDEPOOL_MAX_NUM_SEQS", "3")
        flags = []
    else:
        flags = ["--num-kv-blocks", "9", "--max-num-seqs", "3", "--max-num-batched-tokens", "64",
                 "--max-model-len", "48"]
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--model", tiny_model_dir("llama-gqa"),
                 "--no-progress", *flags]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["completed"] == 1
    line = _pool_lines(caplog)[-1]
    assert line.startswith("KV pool: 9 blocks of 16 tokens") and "max_num_seqs 3" in line
    if not env:
        assert "max_model_len 48" in line


def test_serve_and_worker_take_the_engine_flags():
    from tidepool.workers.cli import build_parser
    for argv in (["serve"], ["worker", "--kind", "cpu"]):
        args = build_parser().parse_args(argv + ["--num-kv-blocks", "5", "--max-num-seqs", "2"])
        from tidepool.workers.engine_commands import engine_overrides
        assert engine_overrides(args) == {"num_kv_blocks": 5, "max_num_seqs": 2}
