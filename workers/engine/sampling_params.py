import json
from dataclasses import dataclass, field

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """Output constrained by a grammar: exactly one of a JSON schema, any JSON object, a regex or a choice list."""
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self):
        if isinstance(self.json_schema, str):
            try:
                object.__setattr__(self, "json_schema", json.loads(self.json_schema))
            except ValueError as exc:
                raise ValueError(f"structured output json_schema is not valid JSON: {exc}") from None
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured output needs exactly one of {list(STRUCTURED_KINDS)}, got {given}")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise ValueError("structured output json_schema must be a JSON object")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured output regex must be a string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured output choice must be a non-empty list of non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the grammar cache key."""
        kind = next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))   # key order matters
        return kind, text


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0                  # drop tokens below min_p * the top token's probability
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0     # Hugging Face style, over prompt and output tokens
    logprobs: int | None = None         # top-N log-probabilities per generated token
    skip_special_tokens: bool = True
    structured: StructuredOutput | dict | None = None   # a dict is StructuredOutput's fields
    n: int = 1                          # choices returned
    best_of: int | None = None          # sequences generated (>= n; None: n); the n with the highest
                                        # cumulative logprob are returned. All share the prompt's KV blocks,
                                        # and sequence i samples with seed + i.
    prompt_logprobs: int | None = None  # top-N log-probabilities of each prompt token after the first (computed
                                        # in prefill; such a prompt bypasses the prefix cache, as in vLLM)
    speculate: bool = True              # False: never draft for this request (speculative decoding opt-out)

    def __post_init__(self):
        if isinstance(self.structured, dict):
            unknown = sorted(set(self.structured) - set(STRUCTURED_KINDS))
            if unknown:
                raise ValueError(f"structured output has unknown field {unknown[0]!r}")
            self.structured = StructuredOutput(**self.structured)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (isinstance(self.top_k, int), "top_k must be an integer"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1"),
            (self.best_of is None or (isinstance(self.best_of, int) and self.best_of >= self.n),
             "best_of must be an integer >= n"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def num_seqs(self) -> int:
        """Sequences generated for the request (best_of, else n)."""
        return self.best_of or self.n

    @property
    def needs_logprob(self) -> bool:
        """The sampled token's logprob is needed: asked for, or to rank best_of sequences."""
        return self.logprobs is not None or self.num_seqs > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
