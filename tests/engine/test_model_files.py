"""The model folders the offline tools write load in `transformers` and carry a working tokenizer."""
import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tidepool.workers.cli import main
from tidepool.workers.tools.tiny_model import CHAT_TEMPLATE, make_tiny_model

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "mistral", "qwen2"]
FILES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json"]
TEXTS = [
    "The tide comes in twice a day.",
    "Hello world!  Two spaces, tabs\tand\nnew lines\n\n",
    "Numbers 12345 and 3.14, punctuation: (a) [b] {c}; 'quotes' \"double\"",
    "Unicode: café, naïve, 日本語, emoji 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}


def _logits(model_dir, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_in_transformers(tiny, arch):
    d = tiny[arch]
    assert all((d / f).is_file() for f in FILES)
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["vocab_size"] == 1000 and config["eos_token_id"] == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert model.dtype == torch.float32
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)  # GQA: 2 kv heads of 16
    has_bias = model.model.layers[0].self_attn.q_proj.bias is not None
    assert has_bias == (arch == "qwen2")
    if has_bias:
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0

    tok = transformers.AutoTokenizer.from_pretrained(d)
    outs = set()
    for prompt in ["The sea is", "Cooking rice", "A short history of computing", "Why is the sky blue?"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
        outs.add(tuple(gen.tolist()))
    assert len(outs) == 4, "greedy outputs of a random model should differ across prompts"


def test_same_seed_same_weights(tiny, tmp_path):
    again = load_file(make_tiny_model(tmp_path / "again", arch="llama") / "model.safetensors")
    other = load_file(make_tiny_model(tmp_path / "other", arch="llama", seed=1) / "model.safetensors")
    first = load_file(tiny["llama"] / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert (tiny["llama"] / "tokenizer.json").read_text() == (tmp_path / "again" / "tokenizer.json").read_text()


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_roundtrips_and_matches_tokenizer_json(tiny, arch):
    hf = transformers.AutoTokenizer.from_pretrained(tiny[arch])
    raw = Tokenizer.from_file(str(tiny[arch] / "tokenizer.json"))
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert hf(text).input_ids == ids  # no BOS added, same pre-tokenisation as tokenizer.json
        assert hf.decode(ids) == text
    assert [raw.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert raw.encode("<|im_start|>user<|im_end|>").ids[0] == 1
    assert hf.eos_token == "<|im_end|>" and hf.eos_token_id == 2


def test_chat_template_renders(tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert json.loads((tiny["llama"] / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_legacy_config_spelling_loads_the_same_model(tmp_path):
    new = make_tiny_model(tmp_path / "new", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0, tie_word_embeddings=True)
    old = make_tiny_model(tmp_path / "old", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0, tie_word_embeddings=True,
                          legacy_config=True)
    new_cfg = json.loads((new / "config.json").read_text())
    old_cfg = json.loads((old / "config.json").read_text())
    assert new_cfg["rope_parameters"]["rope_type"] == "llama3" and "rope_theta" not in new_cfg
    assert "rope_parameters" not in old_cfg and "head_dim" not in old_cfg
    assert old_cfg["rope_theta"] == 500000.0 and old_cfg["rope_scaling"]["rope_type"] == "llama3"
    assert old_cfg["tie_word_embeddings"] is True
    ids = list(range(3, 203))  # past original_max_position_embeddings, where llama3 scaling matters
    assert torch.equal(_logits(new, ids), _logits(old, ids))


def test_cli_make_tiny_model_and_models_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIDEPOOL_MODELS_DIR", str(tmp_path))
    assert main(["make-tiny-model", str(tmp_path / "tiny-mistral"), "--arch", "mistral", "--seed", "1"]) == 0
    assert json.loads((tmp_path / "tiny-mistral" / "config.json").read_text())["model_type"] == "mistral"
    (tmp_path / "not-a-model").mkdir()
    capsys.readouterr()
    assert main(["models", "list"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "tiny-mistral")]
    assert main(["models", "pull", "no-such-model"]) == 2
