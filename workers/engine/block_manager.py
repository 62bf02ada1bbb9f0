"""Paged KV-cache book-keeping: ref-counted blocks, prefix caching by chained hash, LRU eviction, and a
host pool that swapped-out sequences park their blocks in.

Pure Python: it hands out block ids and never touches a tensor.
"""
from collections import OrderedDict

from tidepool.workers.engine.sequence import Sequence


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_host_blocks >= 0")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is reused first. A freed block keeps its hash
        # (and stays findable in hash_to_block) until it is reused.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0     # prompt tokens of admitted sequences looked up in the prefix cache
        self.prefix_hits = 0        # of those, found (counted by the scheduler on admission)
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        # Host blocks read by this step's swap-ins: reusable once the step's copies are done.
        self._host_released: list[int] = []
        self.copies: list[tuple[int, int]] = []   # copy-on-write (src, dst) device copies not yet taken
        self.forks = 0                  # sequences that took their blocks from a sibling (n / best_of)
        self.cow_copies = 0             # shared partial blocks copied before a write

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def blocks_to_finish(self, seq: Sequence, max_model_len: int | None = None) -> int:
        """Blocks seq still needs to reach max_tokens (or max_model_len), beyond those it holds."""
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if max_model_len is not None:
            total = min(total, max_model_len)
        bs = self.block_size
        need = max(0, -(-total // bs) - len(seq.block_table))
        if seq.params.num_seqs > 1 and seq.index == 0 and seq.num_output_tokens == 0:
            # siblings still to be forked: each writes its own output (and a copy of the shared partial block)
            need += (seq.params.num_seqs - 1) * (-(-(total - seq.num_prompt_tokens) // bs) + 1)
        return need

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def match_prefix(self, seq: Sequence) -> None:
        """Admit a fresh sequence onto the cached full blocks of its prefix (never all of its tokens)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return      # prompt logprobs need every prompt position computed
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs     # at least one token is left to compute
        parent = seq.cache_root
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * bs

    def _shared_tail(self, seq: Sequence) -> bool:
        """The next token would be written into a partially filled block that another sequence shares (fork)."""
        return (seq.num_computed_tokens % self.block_size != 0
                and self.blocks[seq.block_table[seq.num_computed_tokens // self.block_size]].ref_count > 1)

    def _copy_on_write(self, seq: Sequence) -> tuple[int, int]:
        """Give seq its own copy of its shared partial block; returns (src, dst) for the device copy."""
        i = seq.num_computed_tokens // self.block_size
        src = seq.block_table[i]
        dst = self._take_free()
        self._release(src)             # still held by the sibling(s): never freed here
        seq.block_table[i] = dst
        self.cow_copies += 1
        return src, dst

    def allocate(self, seq: Sequence, num_new_tokens: int, keep_free: int = 0) -> bool:
        """Make room for num_new_tokens more tokens of seq, leaving at least keep_free blocks free;
        False (and nothing changed) if the pool is short. A shared partially filled block about to be
        written is copied first (copy-on-write): the (src, dst) pair waits in `copies` for `take_copies`."""
        needed = self.blocks_needed(seq, num_new_tokens)
        cow = num_new_tokens > 0 and self._shared_tail(seq)
        if (needed or cow) and needed + cow > len(self.free) - keep_free:
            return False
        if cow:
            self.copies.append(self._copy_on_write(seq))
        seq.block_table.extend(self._take_free() for _ in range(needed))
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) block copies made since the last call: to do before the step runs."""
        copies, self.copies = self.copies, []
        return copies

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that the last step filled completely, so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_root
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)
            parent = h

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent; a shared partial block is copied before either writes into it
        (`allocate`, `append_slot`)."""
        assert not child.block_table
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        self.forks += 1

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Room for one more token. Returns (src, dst) when a shared partial block had to be copied.

        Raises MemoryError when no block is free; callers check `can_append` first.
        """
        bs = self.block_size
        if seq.num_computed_tokens % bs == 0 and seq.num_computed_tokens // bs == len(seq.block_table):
            if not self.free:
                raise MemoryError("no free KV block")
            seq.block_table.append(self._take_free())
            return None
        if not self._shared_tail(seq):
            return None
        if not self.free:
            raise MemoryError("no free KV block")
        return self._copy_on_write(seq)

    def rollback(self, seq: Sequence) -> None:
        """Give back the blocks past seq's computed tokens: a verify step wrote draft positions the target
        rejected. Those blocks were never committed (commit registers only computed tokens), so nothing
        unverified is ever found in the prefix cache; stale slots left in the kept tail block sit past the
        context and are overwritten before anything reads them."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free[block_id] = None

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks first, so a sequence's later (less shareable) blocks are evicted before its prefix.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        self.host_free.extend(seq.host_block_table)
        seq.host_block_table = []
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    # -- swap -----------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(seq.block_table) <= len(self.host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks to the host pool; returns the (device, host) copies to make before the step."""
        assert not seq.host_block_table and self.can_swap_out(seq)
        pairs = [(block_id, self.host_free.pop()) for block_id in seq.block_table]
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.host_block_table = [host for _, host in pairs]
        seq.block_table = []
        return pairs

    def can_swap_in(self, seq: Sequence, keep_free: int = 0) -> bool:
        return len(seq.host_block_table) <= len(self.free) - keep_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give seq fresh device blocks for its host blocks; returns the (host, device) copies to make."""
        assert not seq.block_table and self.can_swap_in(seq)
        seq.block_table = [self._take_free() for _ in seq.host_block_table]
        pairs = list(zip(seq.host_block_table, seq.block_table))
        self._host_released.extend(seq.host_block_table)
        seq.host_block_table = []
        return pairs

    def end_step(self) -> None:
        """The step's copies are done: host blocks swapped in during it may be reused."""
        self.host_free.extend(self._host_released)
        self._host_released = []
