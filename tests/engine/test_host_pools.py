"""One CPU KV budget per host (workers/engine/host_pools.py, model_runner.default_kv_blocks): every engine's pool,
in this process or another, comes out of CPU_KV_SHARE of the memory available to pools; a pool counts from its
allocation until its runner is collected or its process ends."""
import gc
import os
import subprocess

import pytest

from tidepool.workers.engine import EngineConfig, LLMEngine, host_pools, model_runner

MIB = 2**20


@pytest.fixture
def host(monkeypatch, tmp_path):
    """An empty host: its own pools folder, nothing held in this process, 400 MiB available."""
    monkeypatch.setattr(host_pools, "folder", lambda: tmp_path / "pools")
    monkeypatch.setattr(host_pools, "_held", {})
    monkeypatch.setattr(model_runner, "available_memory", lambda: 400 * MIB)
    return tmp_path / "pools"


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, max_num_seqs=256, **kw)     # the memory cap binds, not the sequences'


def test_pools_on_one_host_share_one_budget(tiny_model_dir, host):
    cfg = _config(tiny_model_dir("llama-gqa"))
    block = cfg.kv_block_bytes
    first, why = model_runner.default_kv_blocks(cfg)
    assert first == 100 * MIB // block and why == "25% of available memory"
    held = host_pools.hold(first * block)
    second, why = model_runner.default_kv_blocks(cfg)
    # 25% of what pools may use (400 MiB available + the 100 held), less the 100 held: 25 MiB
    assert second == int(500 * MIB * 0.25 - first * block) // block
    assert why == "25% of available memory, 100 MiB of it held by other pools on this host"
    assert (first + second) * block <= 0.25 * (400 * MIB + first * block)
    host_pools.release(held)
    assert model_runner.default_kv_blocks(cfg)[0] == first


def test_engines_of_one_process_split_it_by_share(tiny_model_dir, host):
    cfg = _config(tiny_model_dir("llama-gqa"), kv_share=0.5)
    assert model_runner.default_kv_blocks(cfg) == (50 * MIB // cfg.kv_block_bytes,
                                                   "25% of available memory, 50% of it")
    with pytest.raises(ValueError, match="kv_share"):
        _config(tiny_model_dir("llama-gqa"), kv_share=0)


def test_a_pool_left_less_than_one_sequence_gets_one(tiny_model_dir, host):
    cfg = _config(tiny_model_dir("llama-gqa"))
    host_pools.hold(200 * MIB)           # more than the host's budget: nothing left
    assert model_runner.default_kv_blocks(cfg)[0] == cfg.blocks_per_sequence


def test_other_processes_pools_count_while_they_live(tiny_model_dir, host):
    cfg = _config(tiny_model_dir("llama-gqa"))
    alone = model_runner.default_kv_blocks(cfg)[0]
    other = subprocess.Popen(["sleep", "60"])
    try:
        host.mkdir(parents=True, exist_ok=True)
        (host / str(other.pid)).write_text(f"{100 * MIB} {host_pools._started(other.pid)}\n")
        (host / "999999999").write_text(f"{100 * MIB} 1\n")           # a process gone: not counted, tidied
        assert host_pools.held_elsewhere() == 100 * MIB
        assert not (host / "999999999").exists()
        assert model_runner.default_kv_blocks(cfg)[0] < alone
        (host / str(other.pid)).write_text(f"{100 * MIB} 1\n")        # its pid reused by another process
        assert host_pools.held_elsewhere() == 0
    finally:
        other.kill()
        other.wait()


def test_an_engine_holds_its_pool_until_it_is_collected(tiny_model_dir, host):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=4, max_model_len=64))
    pool = engine.runner.num_kv_blocks * engine.runner.bytes_per_block
    assert host_pools.held_elsewhere() == pool
    assert (host / str(os.getpid())).read_text().split()[0] == str(pool)      # what other processes read
    del engine
    gc.collect()
    assert host_pools.held_elsewhere() == 0 and not (host / str(os.getpid())).exists()
