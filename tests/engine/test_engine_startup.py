"""What an engine does and says at start-up: a KV pool sized to what max_num_seqs x max_model_len can use (capped
by a share of available memory), reported in a log line; the native CPU kernel built or loaded before the first
request; run-batch, serve and worker take the same engine flags."""
import json
import logging

import pytest

from kernels import cpu_ops
from workers.cli import main
from workers.engine import EngineConfig, LLMEngine
from workers.engine import model_runner


def _pool_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]


def test_pool_is_what_the_sequences_can_use(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO)
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=4, max_model_len=64))
    assert engine.runner.num_kv_blocks == 4 * 64 // 16
    assert _pool_lines(caplog) == ["KV pool: 16 blocks of 16 tokens = 256 tokens, 0 MiB (max_num_seqs x "
                                   "max_model_len; max_num_seqs 4, max_model_len 64)"]


def test_pool_is_capped_by_available_memory(tiny_model_dir, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(model_runner, "available_memory", lambda: 40 * 2**20)
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=256))
    budget = int(40 * 2**20 * model_runner.CPU_KV_SHARE)
    assert engine.runner.num_kv_blocks == budget // engine.runner.bytes_per_block
    assert f"({model_runner.CPU_KV_SHARE:.0%} of available memory;" in _pool_lines(caplog)[0]


def test_native_kernel_is_ready_before_the_first_request(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO)
    LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=2, max_model_len=32))
    said = [r.getMessage() for r in caplog.records if r.name == "workers.engine.model_runner"]
    if not cpu_ops.enabled():
        assert not any("kernel" in m for m in said)
        return
    assert cpu_ops._tried      # built or loaded (or found unavailable) at start, with a line saying which
    assert any(m.startswith(("native CPU decode kernel ready", "native CPU decode kernel unavailable"))
               for m in said), said


@pytest.mark.parametrize("env", [False, True])
def test_run_batch_takes_the_engine_flags(tiny_model_dir, tmp_path, caplog, capsys, monkeypatch, env):
    caplog.set_level(logging.INFO)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "hi", "max_tokens": 3}}) + "\n")
    if env:
        monkeypatch.setenv("TIDEPOOL_KV_BLOCKS", "9")
        monkeypatch.setenv("TIDEPOOL_MAX_NUM_SEQS", "3")
        flags = []
    else:
        flags = ["--kv-blocks", "9", "--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--max-model-len", "48"]
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--model", tiny_model_dir("llama-gqa"),
                 "--no-progress", *flags]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["completed"] == 1
    line = _pool_lines(caplog)[-1]
    assert line.startswith("KV pool: 9 blocks of 16 tokens") and "max_num_seqs 3" in line
    if not env:
        assert "max_model_len 48" in line


def test_serve_and_worker_take_the_engine_flags():
    from workers.cli import build_parser
    for argv in (["serve"], ["worker", "--kind", "cpu"]):
        args = build_parser().parse_args(argv + ["--kv-blocks", "5", "--max-num-seqs", "2"])
        from workers.commands import engine_overrides
        assert engine_overrides(args) == {"num_kv_blocks": 5, "max_num_seqs": 2}
