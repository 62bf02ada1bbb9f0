"""Hypothesis state machine over the block manager: no block leaked or double-owned, prefix hits exact, and
with forks (n / best_of) copy-on-write keeps what every sequence reads through its block table its own; a
speculative verify step's rollback gives back its rejected positions and leaves nothing unverified cached."""
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tidepool.workers.engine.block_manager import BlockManager, chain_hash
from tidepool.workers.engine.sampling_params import SamplingParams
from tidepool.workers.engine.sequence import Sequence

BLOCK = 4
NUM_BLOCKS = 24
# A tiny alphabet and a few shared stems make prefix-cache hits common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]
tokens = st.lists(st.integers(1, 3), min_size=0, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.n = 0
        self.kv: dict[int, dict[int, int]] = {}      # the KV pool as tokens: block -> {slot: token written}

    def _compute(self, seq, upto):
        """The device side of a step: the pending copy-on-write copies, then seq's tokens up to `upto`."""
        for src, dst in self.bm.take_copies():
            self.kv[dst] = dict(self.kv.get(src, {}))
        for p in range(seq.num_computed_tokens, upto):
            self.kv.setdefault(seq.block_table[p // BLOCK], {})[p % BLOCK] = seq.token_ids[p]
        seq.num_computed_tokens = upto

    def _new_seq(self, ids):
        self.n += 1
        return Sequence(f"s{self.n}", ids, SamplingParams())

    @rule(stem=st.sampled_from(range(len(STEMS))), tail=tokens)
    def admit(self, stem, tail):
        ids = STEMS[stem] + tail or [1]
        seq = self._new_seq(ids)
        self.bm.match_prefix(seq)
        for i, block_id in enumerate(seq.block_table):          # every hit holds exactly the prompt's tokens
            block = self.bm.blocks[block_id]
            assert block.token_ids == tuple(ids[i * BLOCK:(i + 1) * BLOCK])
            assert block.hash == chain_hash(seq.block_hashes[i - 1] if i else None, block.token_ids)
        assert seq.num_computed_tokens < len(ids)
        if self.bm.allocate(seq, seq.num_uncomputed_tokens):
            self._compute(seq, seq.num_tokens)
            self.bm.commit(seq)
            self.live.append(seq)
        else:
            self.bm.free_sequence(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 3))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        shared_tail = seq.num_computed_tokens % BLOCK and \
            self.bm.blocks[seq.block_table[seq.num_computed_tokens // BLOCK]].ref_count > 1
        if self.bm.allocate(seq, 1):
            if shared_tail:         # copied before the write: now its own
                assert self.bm.blocks[seq.block_table[seq.num_computed_tokens // BLOCK]].ref_count == 1
            self._compute(seq, seq.num_computed_tokens + 1)
            self.bm.commit(seq)
        else:
            seq.token_ids.pop()
            assert not self.bm.copies

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = self._new_seq(parent.token_ids)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 3))
    def append_slot_copy_on_write(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        if not self.bm.num_free_blocks:
            return
        shared_tail = seq.block_table and self.bm.blocks[seq.block_table[-1]].ref_count > 1
        copy = self.bm.append_slot(seq)
        partial = seq.num_computed_tokens % BLOCK != 0
        if shared_tail and partial:
            assert copy is not None and self.bm.blocks[seq.block_table[-1]].ref_count == 1
        if copy is not None:
            self.kv[copy[1]] = dict(self.kv.get(copy[0], {}))
        seq.token_ids.append(token)
        self._compute(seq, seq.num_computed_tokens + 1)
        self.bm.commit(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 3), drafts=st.lists(st.integers(1, 3), min_size=1, max_size=9),
          accepted=st.integers(0, 9))
    def verify_drafts_and_roll_back(self, data, token, drafts, accepted):
        """A speculative verify step: the last token and k drafts are written in one go, the first `accepted`
        drafts are kept and the rest rolled back."""
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if not self.bm.allocate(seq, 1 + len(drafts)):
            seq.token_ids.pop()
            return
        start = seq.num_computed_tokens
        for src, dst in self.bm.take_copies():
            self.kv[dst] = dict(self.kv.get(src, {}))
        for p, t in enumerate(seq.token_ids[start:] + drafts, start):
            self.kv.setdefault(seq.block_table[p // BLOCK], {})[p % BLOCK] = t
        seq.num_computed_tokens = start + 1
        self.bm.commit(seq)
        kept = min(accepted, len(drafts))
        seq.token_ids.extend(drafts[:kept])
        seq.num_computed_tokens += kept
        self.bm.rollback(seq)
        self.bm.commit(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free_sequence(seq)

    @invariant()
    def every_block_owned_exactly_by_its_refs(self):
        owners = Counter(b for seq in self.live for b in seq.block_table)
        for block in self.bm.blocks:
            assert block.ref_count == owners[block.block_id]
            assert (block.ref_count == 0) == (block.block_id in self.bm.free)
        assert len(self.bm.free) + len(owners) == NUM_BLOCKS
        for seq in self.live:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // BLOCK)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.live:
            read = [self.kv.get(seq.block_table[p // BLOCK], {}).get(p % BLOCK)
                    for p in range(seq.num_computed_tokens)]
            assert read == seq.token_ids[:seq.num_computed_tokens]

    @invariant()
    def hash_index_points_at_matching_blocks(self):
        for h, block_id in self.bm.hash_to_block.items():
            assert self.bm.blocks[block_id].hash == h

    @invariant()
    def cached_blocks_hold_only_their_tokens(self):
        """What a prefix hit would read is what the block's hash says: never a rolled-back draft."""
        for block in self.bm.blocks:
            if block.hash is not None:
                assert tuple(self.kv[block.block_id].get(i) for i in range(BLOCK)) == block.token_ids


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_shared_system_prompt_is_computed_once():
    bm = BlockManager(16, BLOCK)
    system = list(range(10, 22))                  # three full blocks
    first = Sequence("a", system + [1, 2], SamplingParams())
    bm.match_prefix(first)
    assert first.num_cached_tokens == 0
    assert bm.allocate(first, first.num_uncomputed_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.commit(first)
    second = Sequence("b", system + [3], SamplingParams())
    bm.match_prefix(second)
    assert second.num_cached_tokens == 12 and second.block_table == first.block_table[:3]


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(4, BLOCK)
    seqs = []
    for start in (0, 100):
        seq = Sequence(str(start), list(range(start, start + 2 * BLOCK)), SamplingParams())
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.commit(seq)
        seqs.append(seq)
    bm.free_sequence(seqs[0])          # older
    bm.free_sequence(seqs[1])
    hog = Sequence("hog", [5] * (2 * BLOCK), SamplingParams())
    assert bm.allocate(hog, 2 * BLOCK - 1)   # needs 2 blocks: must take seqs[0]'s, keep seqs[1]'s cached
    probe_old = Sequence("p0", list(range(0, 2 * BLOCK)) + [1], SamplingParams())
    probe_new = Sequence("p1", list(range(100, 100 + 2 * BLOCK)) + [1], SamplingParams())
    bm.match_prefix(probe_old)
    bm.match_prefix(probe_new)
    assert probe_old.num_cached_tokens == 0
    assert probe_new.num_cached_tokens == 2 * BLOCK
