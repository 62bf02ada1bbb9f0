"""Seeded random-weight Llama-family models in Hugging Face layout, for fast tests.

Offline tool, not the engine's runtime path: it builds the model with `transformers`' own
classes (so the folder is exactly what `from_pretrained` expects) and trains a small
byte-level BPE on `data/corpus.txt` shipped beside this file.
"""
import json
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2

# SmolLM2-Instruct's ChatML template without its default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
ARCHS = ("llama", "mistral", "qwen2")

# Qwen2's split regex; `transformers` 5 rebuilds any qwen2 tokenizer with it (and NFC), so the
# tiny qwen2 tokenizer uses it too and tokenizer.json stays the whole truth for the engine.
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def train_tokenizer(vocab_size: int = 1000, arch: str = "llama"):
    """Byte-level BPE over the shipped corpus; the same corpus and size always give the same merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if arch == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer=trainer)
    return tok


def make_tiny_model(
    out_dir,
    *,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 1000,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 1024,
    rms_norm_eps: float = 1e-6,
    init_std: float = 0.02,
    legacy_config: bool = False,
) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files to `out_dir`.

    `legacy_config=True` rewrites config.json in the older spelling (top-level `rope_theta` and
    `rope_scaling`, no `head_dim`) that pre-5.0 `transformers` and most published checkpoints use.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if rope_scaling is not None and arch != "llama":
        raise ValueError("rope_scaling is only supported for arch='llama'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(vocab_size, arch)
    vocab_size = tok.get_vocab_size()
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (ENDOFTEXT, IM_END, ENDOFTEXT))

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    rope_parameters = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling is not None:
        rope_parameters.update(rope_scaling)
        rope_parameters["rope_type"] = rope_scaling.get("rope_type", rope_scaling.get("type"))
        rope_parameters.pop("type", None)
    extra = {"sliding_window": None} if arch in ("mistral", "qwen2") else {}
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    if arch == "qwen2":
        # HF zero-initialises biases; random ones make a test fail when the engine drops them.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0.0, init_std)
    model.save_pretrained(out, safe_serialization=True)
    if legacy_config:
        _rewrite_legacy_config(out / "config.json")

    _write_tokenizer(out, tok, max_position_embeddings)
    return out


def _rewrite_legacy_config(path: Path) -> None:
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if cfg.get("head_dim") == cfg["hidden_size"] // cfg["num_attention_heads"]:
        del cfg["head_dim"]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(out: Path, tok, model_max_length: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": ENDOFTEXT, "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {**special, "additional_special_tokens": [IM_START, IM_END]}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
