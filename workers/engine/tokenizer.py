"""tokenizer.json via `tokenizers`, the chat template from tokenizer_config.json via Jinja2, and
incremental detokenisation for streaming."""
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model folder needs tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        # Some tokenizer.json files (BERT exports) pad and truncate every input; the engine does neither unasked.
        self._tok.no_padding()
        self._tok.no_truncation()
        self._truncating: dict[int, HFTokenizer] = {}
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):     # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        self.chat_template = template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """max_length: truncate to that many tokens, the special tokens kept (a BERT input still ends in [SEP])."""
        if max_length is None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        tok = self._truncating.get(max_length)
        if tok is None:
            tok = self._truncating[max_length] = HFTokenizer.from_str(self._tok.to_str())
            tok.enable_truncation(max_length)
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json lacks chat_template)")
        if self._template is None:
            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template itself renders `tools` (else the caller describes them in a system message)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-emitting or splitting characters.

    Decodes a small window of recent tokens twice (with and without the newest) and emits the
    difference, holding back while the tail is an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a stream: emit whatever is held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""
