import itertools
import time
from enum import Enum, auto

from tidepool.workers.engine.sampling_params import SamplingParams

# Highest priority first; the index is the class's rank (lower runs first, preempted last).
SLA_CLASSES = ("realtime", "interactive", "batch", "deferrable")
CLASS_RANK = {name: rank for rank, name in enumerate(SLA_CLASSES)}


ONLINE_RANKS = (CLASS_RANK["realtime"], CLASS_RANK["interactive"])


class SequenceStatus(Enum):
    WAITING = auto()      # not started, or preempted by recompute (no blocks)
    RUNNING = auto()      # holds a seat and its blocks
    SUSPENDED = auto()    # displaced from its seat; keeps its blocks and resumes where it stopped
    SWAPPED = auto()      # displaced for memory; its blocks wait in the host pool
    FINISHED = auto()


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify step of k drafts yields when each draft is accepted with this probability (spec_decode)."""
    return sum(acceptance ** i for i in range(k + 1))


class Sequence:
    _arrivals = itertools.count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 sla_class: str = "interactive", tenant: str = "default", weight: float = 1.0,
                 cache_namespace: str | None = None, lora: str | None = None, pooling=None):
        if sla_class not in CLASS_RANK:
            raise ValueError(f"sla_class must be one of {SLA_CLASSES}, got {sla_class!r}")
        if weight <= 0:
            raise ValueError("tenant weight must be > 0")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.sla_class = sla_class
        self.rank = CLASS_RANK[sla_class]
        self.tenant = tenant
        self.weight = weight
        self.lora = lora                       # the LoRA adapter's name (workers.engine.lora); None: the base model
        # Seeds the chain hash of the first block: prefix-cache blocks are shared only within one namespace and
        # adapter (an adapter's K/V differ from the base model's for the same tokens).
        self.cache_root: int | None = None if cache_namespace is None and lora is None else \
            hash(("namespace", cache_namespace)) if lora is None else hash(("namespace", cache_namespace, "lora", lora))
        self.arrival = next(Sequence._arrivals)
        self.arrival_time = time.monotonic()
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []      # chained hashes of the full blocks registered so far
        self.num_computed_tokens = 0           # tokens whose K/V sit in the cache
        self.num_cached_tokens = 0             # of those, taken from the prefix cache at admission
        self.host_block_table: list[int] = []  # while SWAPPED: host-pool blocks holding block_table's contents
        self.num_preemptions = 0
        self.num_lost_tokens = 0               # computed tokens thrown away by a recompute preemption
        self.finish_reason: str | None = None
        self.grammar = None                    # structured output: its matcher (workers.engine.structured)
        self.index = 0                         # which of its request's sequences (n / best_of > 1) this is
        self.cumulative_logprob = 0.0          # of the sampled tokens (kept when they are computed)
        self.first_token_s: float | None = None   # scheduler clock when its first token was sampled (pace)
        self.draft_token_ids: list[int] = []   # this step's speculative guesses past token_ids (spec_decode)
        self.draft_acceptance = 0.0            # the estimated chance that each of them is accepted (draft_expected)
        # An embedding input (workers.engine.pooling.PoolingParams): computed whole in one step, pooled, never
        # sampled; its KV (a decoder's) is neither shared from nor kept in the prefix cache.
        self.pooling = pooling

    def fork(self, index: int) -> "Sequence":
        """A sibling for choice `index`: same prompt, output and place in line; no blocks yet (the block
        manager's fork shares them) and no grammar state (the caller gives it its own)."""
        child = object.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.token_ids = list(self.token_ids)
        child.block_table, child.block_hashes, child.host_block_table = [], [], []
        child.num_computed_tokens = child.num_cached_tokens = 0
        child.num_preemptions = child.num_lost_tokens = 0
        child.grammar, child.index = None, index
        child.draft_token_ids, child.draft_acceptance = [], 0.0
        return child

    @property
    def draft_expected(self) -> float:
        """How many of this step's drafts are expected to be accepted (what the scheduler's pace room counts as
        delivered): a + a^2 + ... + a^k for k drafts (as many as the step kept) at acceptance a."""
        return expected_tokens(self.draft_acceptance, len(self.draft_token_ids)) - 1

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_online(self) -> bool:
        return self.rank in ONLINE_RANKS

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.sla_class}, tenant={self.tenant!r}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.name})")
