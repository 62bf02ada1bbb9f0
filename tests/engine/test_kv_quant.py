"""A quantized KV cache in the engine (kv_cache_dtype): the pool's size, greedy agreement with the 16-bit cache within
the guard, prefix caching and preemption on a quantized pool, calibration (folder file and registry), and the
fallback to the 16-bit cache with its warning line and metrics."""
import logging

import pytest
import torch

from tests.engine.test_preemption_parity import run_mixed
from tidepool.workers.engine import LLMEngine
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.kv_calibration import calibrate
from tidepool.workers.engine.kv_scales import MAX_LOSS, judge, load_calibration, save_calibration
from tidepool.workers.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8")


def test_pool_holds_more_tokens_in_the_same_memory(tiny_model_dir):
    model = tiny_model_dir("llama-gqa")
    budget = 4 * 2**20
    blocks, row_bytes = {}, {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("bfloat16", "fp8_e4m3")):
        config = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=budget,
                              max_num_seqs=1024)
        blocks[dtype, kv] = budget // config.kv_block_bytes
        row_bytes[dtype, kv] = config.kv_block_bytes
    head_dim = config.model_config.head_dim
    # a quantized row: head_dim codes and its 2-byte scale, against head_dim elements of 4 or 2 bytes
    assert row_bytes["float32", "int8"] * 4 * head_dim == row_bytes["float32", "auto"] * (head_dim + 2)
    assert row_bytes["bfloat16", "fp8_e4m3"] * 2 * head_dim == row_bytes["bfloat16", "auto"] * (head_dim + 2)
    assert blocks["float32", "int8"] >= 3.5 * blocks["float32", "auto"]         # head_dim 16 here; 64: 3.88x
    assert blocks["bfloat16", "fp8_e4m3"] >= 1.75 * blocks["bfloat16", "auto"]    # 64: 1.94x
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=model, kv_cache_dtype="fp4")


@pytest.fixture(scope="module")
def calibrated(tiny_model_dir, tmp_path_factory):
    """The tiny model's calibration record (a copy of the folder, so the shared one stays uncalibrated)."""
    import shutil
    folder = tmp_path_factory.mktemp("calibrated") / "model"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    gen = torch.Generator().manual_seed(0)
    vocab = EngineConfig(model=str(folder)).model_config.vocab_size
    texts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (64, 48, 64, 40, 64, 64)]
    record = judge(calibrate(str(folder), texts[:4], texts[4:]))
    save_calibration(folder, record)
    return str(folder), record


def test_calibration_measures_every_dtype_within_the_guard_for_int8(calibrated):
    folder, record = calibrated
    m = EngineConfig(model=folder).model_config
    k_amax = torch.tensor(record["k_amax"])      # per (layer, KV head, channel)
    assert k_amax.shape == (m.num_hidden_layers, m.num_key_value_heads, m.head_dim) and (k_amax > 0).all()
    assert set(record["accuracy"]) == set(QUANTIZED)
    int8 = record["accuracy"]["int8"]
    assert int8["top1_agreement"] >= 1 - MAX_LOSS and int8["ppl_increase"] <= 0.01 and not int8["refused"]
    for figures in record["accuracy"].values():       # a random model's logits are near ties: fp8 flips some
        assert 0.85 <= figures["top1_agreement"] <= 1 and figures["mean_kl"] < 0.01
    assert load_calibration(folder) == record


@pytest.mark.parametrize("kv", QUANTIZED)
def test_greedy_agrees_with_the_16bit_cache(calibrated, random_prompts, kv):
    """The calibrated scales (the figures left out, so that the guard does not refuse fp8 on a random model, whose
    near-tied logits flip more often than a trained model's): first tokens agree about as often as the calibration
    measured."""
    folder, record = calibrated
    prompts = random_prompts(12, EngineConfig(model=folder).model_config.vocab_size, seed=3, lengths=(8, 60))
    scales = {k: v for k, v in record.items() if k != "accuracy"}

    def run(kv_cache_dtype):
        engine = LLMEngine(EngineConfig(model=folder, kv_cache_dtype=kv_cache_dtype, kv_cache_calibration=scales,
                                        num_kv_blocks=160, calibrate=False))
        return run_mixed(engine, prompts), engine
    ref, _ = run("auto")
    got, engine = run(kv)
    assert engine.runner.kv_dtype.itemsize == 1
    first = [a[0] == b[0] for a, b in zip(ref, got)]      # the first token reads the prompt's KV only
    assert sum(first) / len(first) >= record["accuracy"][kv]["top1_agreement"] - 0.2     # 12 draws: ~0.09 noise


@pytest.mark.parametrize("scenario", ["suspend", "swap", "recompute"])
def test_preemption_and_prefix_cache_on_a_quantized_pool(tiny_model_dir, random_prompts, scenario):
    """Preempted (and prefix-cached) sequences on an int8 pool give what an undisturbed int8 engine gives."""
    from tests.engine.test_preemption_parity import SCENARIOS
    model = tiny_model_dir("llama-gqa")
    overrides, must, _ = SCENARIOS[scenario]
    prompts = random_prompts(12, EngineConfig(model=model).model_config.vocab_size, seed=7, lengths=(20, 90),
                             shared_prefix=24)
    ref = run_mixed(LLMEngine(EngineConfig(model=model, kv_cache_dtype="int8", num_kv_blocks=512,
                                           enable_prefix_caching=False, calibrate=False)), prompts)
    engine = LLMEngine(EngineConfig(model=model, kv_cache_dtype="int8", calibrate=False, **overrides))
    got = run_mixed(engine, prompts)
    stats = engine.stats()
    assert stats["preemptions_by_kind"][must] > 0 and stats["prefix_cache_hits"] > 0, stats
    same = sum(a == b for a, b in zip(ref, got))
    # swap and suspend keep the codes; a recomputed prefix may round a value the other way, rarely
    assert same == len(ref) if scenario != "recompute" else same >= len(ref) - 2


def test_forks_and_cow_on_a_quantized_pool(tiny_model_dir):
    model = tiny_model_dir("llama-gqa")
    engine = LLMEngine(EngineConfig(model=model, kv_cache_dtype="fp8_e4m3", calibrate=False, num_kv_blocks=64))
    engine.add_request("n", list(range(5, 45)), SamplingParams(n=3, max_tokens=8, temperature=0.0))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished and o.outputs]
    choices = [c.token_ids for c in done[-1].outputs]
    assert len(choices) == 3 and all(c == choices[0] for c in choices)     # greedy forks share blocks and agree
    assert engine.stats()["forked_seqs"] > 0


def test_a_refused_dtype_falls_back_to_16_bits_with_one_warning(calibrated, caplog):
    folder, record = calibrated
    bad = {**record, "accuracy": {"fp8_e5m2": {**record["accuracy"]["fp8_e5m2"], "top1_agreement": 0.9}}}
    caplog.set_level(logging.WARNING)
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_dtype="fp8_e5m2", kv_cache_calibration=judge(bad),
                                    num_kv_blocks=32, calibrate=False))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "kv_cache_dtype" in
                r.getMessage()]
    assert len(warnings) == 1 and "top-1 agreement 90.00%" in warnings[0] and "16-bit" in warnings[0]
    assert engine.runner.kv_dtype == engine.runner.dtype
    stats = engine.stats()
    assert stats["kv_cache_dtype"] == "auto" and stats["kv_quant_fallbacks"] == 1

    from prometheus_client import generate_latest

    from tidepool.workers.metrics import EngineMetrics
    metrics = EngineMetrics(worker="w1")
    metrics.update_from_stats(stats)
    text = generate_latest(metrics.registry).decode()
    assert 'tidepool:kv_cache_dtype{dtype="auto",worker="w1"} 1.0' in text
    assert 'tidepool:kv_quant_fallbacks_total{worker="w1"} 1.0' in text


def test_dynamic_scales_are_said_once_at_start(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO)
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), kv_cache_dtype="int8", num_kv_blocks=32,
                                    calibrate=False))
    lines = [r.getMessage() for r in caplog.records if "dynamic scales" in r.getMessage()]
    assert len(lines) == 1
    attn = engine.runner.model.layers[0].self_attn
    assert attn.k_scale.shape == (attn.num_kv_heads, attn.head_dim) and (attn.k_scale > 0).all()


def test_calibrate_kv_round_trips_through_the_registry(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`tidepool models calibrate-kv NAME`: the folder's kv_cache_scales.json and the registry's copy are one record,
    which the workers pass on (model_engine_fields) and the registry shows (dtype in use, loss)."""
    import json
    import shutil

    from tidepool.service.ledger.database import make_engine
    from tidepool.service.ledger.registry import Registry, entry_json
    from tidepool.workers.cli import main
    from tidepool.workers.config_fields import model_engine_fields
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", url)
    monkeypatch.delenv("TIDEPOOL_MODEL", raising=False)
    monkeypatch.delenv("TIDEPOOL_KV_CACHE_DTYPE", raising=False)
    assert main(["db", "upgrade"]) == 0
    assert main(["models", "register", "tiny", str(folder), "--kv-cache-dtype", "int8"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["kv_cache_dtype"] == "int8"
    assert main(["models", "calibrate-kv", "tiny", "--samples", "16"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["registry"] and printed["samples"] == 16 and set(printed["accuracy"]) == set(QUANTIZED)
    record = load_calibration(folder)
    db = make_engine(url)
    try:
        entry = Registry(db, ttl=0).entries()["tiny"]
    finally:
        db.dispose()
    assert entry.kv_cache_calibration == record
    shown = entry_json(entry)
    assert shown["kv_cache_dtype"] == "int8" and shown["kv_cache_loss"] == record["accuracy"]["int8"]["loss"]
    assert shown["kv_cache_dtype_in_use"] == ("auto" if record["accuracy"]["int8"]["refused"] else "int8")
    fields = model_engine_fields(entry)
    assert fields["kv_cache_dtype"] == "int8" and fields["kv_cache_calibration"] == record
    (folder / "kv_cache_scales.json").unlink()      # the registry's copy alone serves the engine
    config = EngineConfig(model=str(folder), **fields)
    assert config.kv_choice.calibration == record and config.kv_choice.measured == record["accuracy"]["int8"]
