"""Embedding requests (/v1/embeddings, and the same body in /v1/jobs and batch lines): the body's checks, how the
vectors are stored in the ledger (a job's `output`: a JSON list of base64 little-endian float32 vectors, OpenAI's
base64 encoding) and the OpenAI response built from them. Flask- and torch-free; the workers write what
`stored` gives and the API reads it back with `data`."""
import base64
import json
import sys
from array import array
from pathlib import Path

from .errors import bad_request

MAX_INPUTS = 2048              # inputs in one request (OpenAI's limit)
MAX_BATCH_INPUTS = 50_000      # inputs across the lines of one batch (OpenAI's limit)
MAX_INPUT_CHARS = 1 << 21      # characters of all of a request's inputs together
MAX_TOKEN_ID = (1 << 31) - 1
MAX_INPUT_TOKEN_IDS = 1 << 16  # ids in one token-id input
MAX_DIMENSIONS = (1 << 31) - 1
ALLOWED = {"model", "input", "encoding_format", "dimensions", "user", "truncate"}
FORMATS = ("float", "base64")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def inputs(value) -> list:
    """The request's `input` as a list of inputs (strings or token-id lists); a 400 naming `input` otherwise."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a non-empty string, a non-empty list of strings, a non-empty list of "
                          "token ids, or a non-empty list of token-id lists.", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"'input' has {len(value)} inputs; at most {MAX_INPUTS} are allowed in one request.",
                          "input", "array_above_max_length")
    strings = isinstance(value[0], str)
    chars = 0
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if strings:
            if not isinstance(item, str):
                raise bad_request(f"'{where}' must be a string like the other inputs.", where)
            if not item:
                raise bad_request(f"'{where}' must not be empty.", where)
            chars += len(item)
            if chars > MAX_INPUT_CHARS:
                raise bad_request(f"'input' holds more than {MAX_INPUT_CHARS} characters.", "input",
                                  "string_above_max_length")
        elif not isinstance(item, list) or not item or len(item) > MAX_INPUT_TOKEN_IDS or \
                not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in item):
            raise bad_request(f"'{where}' must be a non-empty list of at most {MAX_INPUT_TOKEN_IDS} token ids, like "
                              f"the other inputs.", where)
    return value


def estimate(items: list) -> int:
    """Admission estimate of the input tokens without the model's tokenizer: a string's UTF-8 bytes (no tokenizer
    makes more tokens than that), plus two special tokens."""
    return sum(len(i.encode()) + 2 if isinstance(i, str) else len(i) for i in items)


class EmbedModel:
    """What the API checks against an embedding model's folder: the `dimensions` it accepts (config.json's
    matryoshka_dimensions) and its tokenizer and max_seq_length, so inputs are counted exactly and an over-long
    one is a 400 before anything is written (the engine applies the same limit)."""

    def __init__(self, folder: str):
        from tokenizers import Tokenizer
        path = Path(folder)
        raw = _read(path / "config.json") or {}
        self.dimensions = tuple(d for d in raw.get("matryoshka_dimensions") or () if isinstance(d, int))
        self.max_len = (_read(path / "sentence_bert_config.json") or {}).get("max_seq_length") \
            or raw.get("max_position_embeddings")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    def count(self, items: list, truncate: bool) -> int:
        """Input tokens of the request (each cut to max_len when truncate); a 400 naming the over-long input."""
        texts = [(i, t) for i, t in enumerate(items) if isinstance(t, str)]
        lengths = [len(t) for t in items]
        for (i, _), enc in zip(texts, self.tokenizer.encode_batch([t for _, t in texts]) if texts else []):
            lengths[i] = len(enc.ids)
        total = 0
        for i, n in enumerate(lengths):
            if self.max_len and n > self.max_len:
                if not truncate:
                    where = f"input[{i}]" if len(items) > 1 else "input"
                    raise bad_request(f"'{where}' has {n} tokens; this model embeds at most {self.max_len} "
                                      f"(send truncate: true to cut it).", where, "context_length_exceeded")
                n = self.max_len
            total += n
        return total


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check(body: dict, extra_allowed=frozenset(), embed_model: EmbedModel | None = None) -> tuple[dict, int]:
    """(the normalised body, its input-token estimate) of an embeddings body whose strings bodies.check has
    checked; with the model's EmbedModel, `dimensions` and the inputs' lengths are checked and the estimate is
    exact."""
    dimensions_allowed = None if embed_model is None else embed_model.dimensions
    unknown = sorted(set(body) - ALLOWED - set(extra_allowed))
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > 256):
        raise bad_request("'model' must be a string of at most 256 characters.", "model")
    if "input" not in body:
        raise bad_request("'input' is required.", "input", "missing_required_parameter")
    items = inputs(body["input"])
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in FORMATS:
        raise bad_request(f"'encoding_format' must be one of {list(FORMATS)}.", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None:
        if not _is_int(dims) or not 1 <= dims <= MAX_DIMENSIONS:
            raise bad_request(f"'dimensions' must be an integer in [1, {MAX_DIMENSIONS}].", "dimensions")
        if dimensions_allowed is not None and dims not in dimensions_allowed:
            raise bad_request("This model does not support 'dimensions'." if not dimensions_allowed else
                              f"'dimensions' must be one of {sorted(dimensions_allowed)} for this model.",
                              "dimensions", "unsupported_parameter")
    if not isinstance(body.get("truncate"), (bool, type(None))):
        raise bad_request("'truncate' must be a boolean.", "truncate")
    if body.get("user") is not None and (not isinstance(body["user"], str) or len(body["user"]) > 256):
        raise bad_request("'user' must be a string of at most 256 characters.", "user")
    clean = {k: v for k, v in body.items() if k not in extra_allowed and v is not None}
    tokens = estimate(items) if embed_model is None else embed_model.count(items, bool(body.get("truncate")))
    return clean, tokens


def count(body: dict) -> int:
    """Inputs in a checked body."""
    value = body["input"]
    return 1 if isinstance(value, str) or (value and _is_int(value[0])) else len(value)


# ---- storage and response ---------------------------------------------------------------------------------

def _pack(vector) -> str:
    a = array("f", vector)
    if sys.byteorder != "little":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode()


def _unpack(text: str) -> list[float]:
    a = array("f")
    a.frombytes(base64.b64decode(text))
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def stored(vectors: list) -> str:
    """The ledger's `output` of an embedding job."""
    return json.dumps([_pack(v) for v in vectors])


def data(output: str | None, request: dict | None) -> list[dict]:
    """The OpenAI `data` list of a completed embedding job, in the request's encoding_format."""
    b64 = (request or {}).get("encoding_format") == "base64"
    return [{"object": "embedding", "index": i, "embedding": v if b64 else _unpack(v)}
            for i, v in enumerate(json.loads(output or "[]"))]


def usage(prompt_tokens: int | None) -> dict:
    return {"prompt_tokens": prompt_tokens or 0, "total_tokens": prompt_tokens or 0}


def response_body(output: str | None, request: dict | None, model: str | None, prompt_tokens: int | None) -> dict:
    return {"object": "list", "data": data(output, request), "model": model, "usage": usage(prompt_tokens)}
