"""Embeddings: all-MiniLM-L6-v2 through the engine equals sentence-transformers (cosine >= 0.9999 per input) however
its inputs share steps; a decoder embeds through the same pooling code beside decode work."""
import json
import random
import shutil

import pytest
import torch

from tidepool.workers.engine import LLM, LLMEngine, EngineConfig, PromptTooLong, SamplingParams
from tidepool.workers.engine.pooling import PoolingParams, PoolingSpec

WORDS = ["tide", "pool", "ocean", "the", "a", "of", "embedding", "vector", "quick", "brown", "fox", "Straße", "café",
         "naïve", "日本語", "中文", "Ελληνικά", "русский", "🚀", "🔥", "👍🏽", "🇫🇷", "⌘", "x", "-", "123", "e=mc²"]


def varied_inputs(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    fixed = ["a", ".", " ", "?", "hello", "🚀", "Ünïcödé straße", "👍🏽🇫🇷", "word " * 400, "émoji " * 300]
    out = list(fixed)
    while len(out) < n:
        k = rng.choice([1, 2, 3, 5, 8, 12, 20, 40])
        out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k))))
    return out


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer
    texts = varied_inputs()
    model = SentenceTransformer(minilm_dir, device="cpu")
    return texts, torch.tensor(model.encode(texts, batch_size=64, convert_to_numpy=True))


def assert_close(got, want):
    cos = torch.nn.functional.cosine_similarity(torch.tensor(got), want)
    assert cos.min().item() >= 0.9999, (cos.argmin().item(), cos.min().item())


def test_spec_is_read_from_the_sentence_transformers_files(minilm_dir, tmp_path):
    spec = PoolingSpec.from_dir(minilm_dir, encoder=True)
    assert (spec.modes, spec.normalize, spec.max_seq_length) == (("mean",), True, 256)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert PoolingSpec.from_dir(bare, encoder=True).modes == ("mean",)
    assert PoolingSpec.from_dir(bare, encoder=False).modes == ("lasttoken",)
    (bare / "modules.json").write_text(json.dumps([{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="Dense"):
        PoolingSpec.from_dir(bare, encoder=True)


def test_alone_packed_and_mixed_classes_match_sentence_transformers(minilm_dir, reference):
    texts, want = reference
    truncate = PoolingParams(truncate=True)
    alone = LLM(minilm_dir, max_num_seqs=1, calibrate=False)          # one input per step
    assert_close(alone.embed(texts[:40], truncate), want[:40])
    packed = LLM(minilm_dir, max_num_seqs=64, max_num_batched_tokens=64 * 256)
    assert_close(packed.embed(texts, truncate, per_request=64), want)  # 64 inputs per step, one request each
    assert packed.engine.stats()["total_steps"] < 10
    engine = packed.engine                                            # realtime single inputs among batch lists
    for i in range(0, len(texts), 40):
        engine.add_request(f"b{i}", texts[i:i + 40], truncate, sla_class="batch")
        engine.add_request(f"r{i}", [texts[i + 1]], truncate, sla_class="realtime")
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    got = [outs[f"b{i}"].embeddings for i in range(0, len(texts), 40)]
    assert_close([v for chunk in got for v in chunk], want)
    assert_close([outs[f"r{i}"].embeddings[0] for i in range(0, len(texts), 40)], want[1::40])
    tokens = sum(len(o.prompt_token_ids) for o in outs.values())
    assert engine.stats()["total_embedded_tokens"] >= tokens > 0


def test_a_realtime_input_goes_into_the_next_step(minilm_dir):
    llm = LLM(minilm_dir, max_num_seqs=4, max_num_batched_tokens=4 * 64, calibrate=False)
    engine = llm.engine
    engine.add_request("bulk", ["word " * 60] * 12, PoolingParams(truncate=True), sla_class="batch")
    engine.step()
    engine.add_request("rt", ["urgent"], PoolingParams(), sla_class="realtime")
    assert [o.request_id for o in engine.step() if o.finished] == ["rt"]
    while engine.has_unfinished():
        engine.step()


def test_over_long_inputs_are_refused_or_truncated(minilm_dir):
    engine = LLM(minilm_dir).engine
    with pytest.raises(PromptTooLong, match="at most 256"):
        engine.add_request("long", ["word " * 300], PoolingParams())
    with pytest.raises(PromptTooLong):
        engine.add_request("long-ids", [[1000] * 257], PoolingParams())
    ids = engine.embed_ids(["word " * 300, [1000] * 300], PoolingParams(truncate=True))
    assert [len(i) for i in ids] == [256, 256] and ids[0][-1] == 102      # the text keeps its [SEP]
    for bad in ([], [[]], [[10 ** 9]]):
        with pytest.raises(ValueError):
            engine.add_request("bad", bad, PoolingParams())
    with pytest.raises(ValueError, match="embedding model"):
        engine.add_request("gen", "hello", SamplingParams())
    assert not engine.has_unfinished()


def test_dimensions_cut_and_renormalise(minilm_dir):
    llm = LLM(minilm_dir)
    full, cut = llm.embed(["tide pool"])[0], llm.embed(["tide pool"], PoolingParams(dimensions=64))[0]
    want = torch.nn.functional.normalize(torch.tensor(full[:64]), dim=0)
    assert len(cut) == 64 and torch.allclose(torch.tensor(cut), want, atol=1e-6)


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_decoder_embeds_beside_decode_work(tiny_model_dir, tmp_path, mode):
    """A Llama-family model embeds with last-token (its default) or mean pooling, inputs sharing steps with
    running decodes, equal to transformers' last hidden state pooled the same way; the decodes are unchanged."""
    from transformers import AutoModel
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    if mode == "mean":
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
        (folder / "modules.json").write_text(json.dumps([
            {"path": "", "type": "sentence_transformers.models.Transformer"},
            {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    rng = random.Random(3)
    inputs = [[rng.randrange(1, 1000) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        states = [hf(torch.tensor([ids])).last_hidden_state[0] for ids in inputs]
    want = torch.stack([s[-1] if mode == "lasttoken" else s.mean(0) for s in states])
    if mode == "lasttoken":
        want = torch.nn.functional.normalize(want, dim=-1)

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64, calibrate=False))
    alone = {}
    for i in range(3):
        engine.add_request(f"g{i}", inputs[i], greedy)
    while engine.has_unfinished():
        alone.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    for i in range(3):
        engine.add_request(f"g{i}", inputs[i], greedy)
    engine.step()                                         # the decodes are running when the embeddings arrive
    for i, ids in enumerate(inputs):
        engine.add_request(f"e{i}", [ids], PoolingParams(), sla_class="batch" if i % 2 else "realtime")
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    got = torch.tensor([outs[f"e{i}"].embeddings[0] for i in range(len(inputs))])
    assert torch.nn.functional.cosine_similarity(got, want).min().item() >= 0.9999
    if mode == "mean":
        assert torch.allclose(got, want, atol=1e-4)       # not normalised: its modules.json has no Normalize
    assert {f"g{i}": outs[f"g{i}"].token_ids for i in range(3)} == alone
