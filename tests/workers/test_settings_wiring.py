"""The worker's, the engine's and beat's configs are built from the one settings object (service/ledger/settings.py):
each TIDEPOOL_* value reaches the field it names, and what the docs show as an engine default is the engine's."""
import dataclasses

import pytest

from tidepool.service.ledger.settings import Config, variables
from tidepool.workers.celery_app import make_celery
from tidepool.workers.engine.config import DEFAULT_SLA_TARGETS, EngineConfig
from tidepool.workers.config_fields import engine_fields
from tidepool.workers.worker import WorkerConfig


def _settings(tmp_path, **env) -> Config:
    env.setdefault("TIDEPOOL_DATABASE_URL", f"sqlite:///{tmp_path}/t.db")
    return Config.from_env({"storage_dir": str(tmp_path)}, environ={k: str(v) for k, v in env.items()})


def test_the_docs_show_the_engines_own_defaults():
    shown = {env: text for env, text, _ in variables()}
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert shown["TIDEPOOL_MAX_NUM_SEQS"] == f"`{engine['max_num_seqs']}`"
    assert shown["TIDEPOOL_MAX_NUM_BATCHED_TOKENS"] == f"`{engine['max_num_batched_tokens']}`"
    assert shown["TIDEPOOL_CAPACITY_POLICY"] == f"`{engine['capacity_policy']}`"
    assert shown["TIDEPOOL_ONLINE_RESERVE"] == f"`{engine['online_reserve']}`"
    assert shown["TIDEPOOL_OFFLINE_FLOOR"] == f"`{engine['offline_floor']}`"
    assert shown["TIDEPOOL_ENFORCE_EAGER"] == f"`{int(engine['enforce_eager'])}`"
    assert shown["TIDEPOOL_TENSOR_PARALLEL_SIZE"] == f"`{engine['tensor_parallel_size']}`"
    assert shown["TIDEPOOL_COLLECTIVE_TIMEOUT_S"] == f"`{engine['collective_timeout_s']:g}`"
    for cls in ("realtime", "interactive"):
        for target in ("ttft_ms", "itl_ms"):
            gpu, cpu = DEFAULT_SLA_TARGETS["cuda"][cls][target], DEFAULT_SLA_TARGETS["cpu"][cls][target]
            assert shown[f"TIDEPOOL_SLA_{cls.upper()}_{target.upper()}"] == f"GPU {gpu:g}, CPU {cpu:g}"


def test_an_engine_setting_is_the_engine_config_field_of_its_name():
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    settings = [f.name for f in dataclasses.fields(Config) if f.metadata.get("engine")]
    assert "num_kv_blocks" in settings and not [name for name in settings if name not in engine]


def test_the_worker_config_comes_from_the_settings(tmp_path):
    s = _settings(tmp_path, TIDEPOOL_MODEL=tmp_path / "m", TIDEPOOL_LEASE_SECONDS=7, TIDEPOOL_VISIBILITY_TIMEOUT=99,
                  TIDEPOOL_LOW_WATER=2, TIDEPOOL_WORKER_NAME="w-7", TIDEPOOL_METRICS_PORT=0, TIDEPOOL_NUM_KV_BLOCKS=12,
                  TIDEPOOL_CAPACITY_POLICY="no_evict", TIDEPOOL_SLA_REALTIME_ITL_MS=75, TIDEPOOL_OFFLINE_FLOOR=0.3,
                  TIDEPOOL_TENSOR_PARALLEL_SIZE=2, TIDEPOOL_COLLECTIVE_TIMEOUT_S=5, TIDEPOOL_DEVICE_MEMORY_GIB=0.5)
    cfg = WorkerConfig.from_env(kind="cpu", device="cpu", settings=s)
    assert (cfg.model, cfg.lease_seconds, cfg.visibility_timeout, cfg.low_water, cfg.name, cfg.metrics_port) == \
        (str(tmp_path / "m"), 7.0, 99.0, 2, "w-7", 0)
    assert cfg.engine["num_kv_blocks"] == 12 and cfg.engine["capacity_policy"] == "no_evict"
    assert cfg.engine["offline_floor"] == 0.3
    tp = ("tensor_parallel_size", "collective_timeout_s", "device_memory_gib")
    assert [cfg.engine[name] for name in tp] == [2, 5.0, 0.5]
    assert cfg.engine["sla_targets"] == {"realtime": {"ttft_ms": 600.0, "itl_ms": 75.0},
                                         "interactive": dict(DEFAULT_SLA_TARGETS["cpu"]["interactive"])}


def test_unset_engine_settings_leave_the_engines_defaults(tmp_path, tiny_model):
    s = _settings(tmp_path)
    assert engine_fields(s, "cpu") == {}
    cfg = EngineConfig(model=tiny_model, device="cpu", **engine_fields(s, "cpu"))
    assert (cfg.capacity_policy, cfg.online_reserve, cfg.enforce_eager, cfg.swap_space_gib) == \
        ("max_utilization", 0.1, False, 0.0)
    assert (cfg.tensor_parallel_size, cfg.collective_timeout_s, cfg.device_memory_gib) == (1, 60.0, None)
    assert cfg.sla_targets == DEFAULT_SLA_TARGETS["cpu"]


def test_the_cpu_kernel_switch_reaches_the_kernels_through_the_engine(tmp_path, tiny_model, monkeypatch):
    from tidepool.kernels import cpu_ops
    from tidepool.workers.engine import LLMEngine
    monkeypatch.setattr(cpu_ops, "_enabled", True)     # both restored after the test
    monkeypatch.setattr(cpu_ops, "_cache_dir", cpu_ops._cache_dir)
    fields = engine_fields(_settings(tmp_path, TIDEPOOL_CPU_KERNELS=0, TIDEPOOL_KERNEL_CACHE=tmp_path / "k"), "cpu")
    assert fields == {"cpu_kernels": False, "kernel_cache": str(tmp_path / "k")}
    LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=8, calibrate=False, **fields))
    assert not cpu_ops.enabled() and cpu_ops.paged_decode_op() is None
    assert cpu_ops.cache_dir() == tmp_path / "k"


def test_the_tensor_parallel_flag_wins_over_its_variable_on_every_engine_command(tmp_path):
    from tidepool.workers.cli import build_parser
    from tidepool.workers.engine_commands import engine_overrides
    s = _settings(tmp_path, TIDEPOOL_TENSOR_PARALLEL_SIZE=2)
    for command in (["worker"], ["serve"], ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]):
        args = build_parser().parse_args([*command, "--tensor-parallel-size", "4"])
        assert {**engine_fields(s, "cpu"), **engine_overrides(args)}["tensor_parallel_size"] == 4, command
        assert "tensor_parallel_size" not in engine_overrides(build_parser().parse_args(command))


def test_beat_takes_its_intervals_from_the_settings(tmp_path):
    s = _settings(tmp_path, TIDEPOOL_SWEEP_INTERVAL=3, TIDEPOOL_VISIBILITY_TIMEOUT=120,
                  TIDEPOOL_BEAT_SCHEDULE=tmp_path / "beat")
    app = make_celery(s)
    assert app.conf.broker_transport_options["visibility_timeout"] == 120.0
    assert app.conf.beat_schedule["sweep"]["schedule"] == 3.0
    assert app.conf.beat_schedule_filename == str(tmp_path / "beat")


@pytest.mark.parametrize("env", [{"TIDEPOOL_LOW_WATER": "0"}, {"TIDEPOOL_METRICS_PORT": "70000"}])
def test_the_worker_refuses_bad_settings_naming_them(tmp_path, env):
    with pytest.raises(ValueError, match=next(iter(env))):
        WorkerConfig.from_env(kind="cpu", device="cpu", settings=_settings(tmp_path, **env))
