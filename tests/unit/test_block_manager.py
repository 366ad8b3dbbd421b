"""The block manager never leaks or double-frees under random allocate / rollback / fork / free / preempt."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specserve.engine.block_manager import BlockManager, NoFreeBlocksError

NUM_BLOCKS, BLOCK_SIZE = 12, 4


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.slots: dict[str, int] = {}  # model of the expected slot count per sequence
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    @rule(n=st.integers(0, 20))
    def add_sequence(self, n: int) -> None:
        sid = self._new_id()
        if self.bm.can_allocate(sid, n):
            self.bm.allocate(sid, n)
            self.slots[sid] = n
        else:
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(sid, n)
            assert not self.bm.block_table(sid)

    @precondition(lambda self: self.slots)
    @rule(data=st.data(), n=st.integers(0, 9))
    def append(self, data, n: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.slots)))
        if self.bm.can_allocate(sid, n):
            self.bm.allocate(sid, n)
            self.slots[sid] += n
        else:
            before = list(self.bm.block_table(sid))
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(sid, n)
            assert self.bm.block_table(sid) == before

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def rollback(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.slots)))
        n = data.draw(st.integers(0, self.slots[sid]))
        self.bm.rollback(sid, n)
        self.slots[sid] -= n

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.slots)))
        self.bm.free(sid)
        del self.slots[sid]

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.slots)))
        child = self._new_id()
        self.bm.fork(parent, child)
        self.slots[child] = (self.slots[parent] // BLOCK_SIZE) * BLOCK_SIZE
        assert self.bm.block_table(child) == self.bm.block_table(parent)[: len(self.bm.block_table(child))]

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def preempt_newest(self, data) -> None:
        """Preemption by recompute frees everything the victim holds."""
        sid = max(self.slots, key=lambda s: int(s[1:]))
        self.bm.free(sid)
        del self.slots[sid]

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        for sid, n in self.slots.items():
            assert self.bm.num_slots(sid) == n
            assert len(self.bm.block_table(sid)) == -(-n // BLOCK_SIZE)
        # Blocks in use are exactly the distinct blocks named by live tables.
        used = {b for sid in self.slots for b in self.bm.block_table(sid)}
        assert self.bm.num_free_blocks == NUM_BLOCKS - len(used)

    def teardown(self) -> None:
        for sid in list(self.slots):
            self.bm.free(sid)
        assert self.bm.num_free_blocks == NUM_BLOCKS, "blocks leaked"


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_rollback_releases_emptied_blocks() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a", 10)  # blocks for slots 0-3, 4-7, 8-9
    assert len(bm.block_table("a")) == 3
    bm.rollback("a", 2)  # slots 8, 9 gone -> third block freed
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 6
    bm.rollback("a", 1)  # slot 7 gone, block 2 still holds 4-6
    assert len(bm.block_table("a")) == 2
    with pytest.raises(ValueError, match="roll back"):
        bm.rollback("a", 8)


def test_shared_blocks_survive_until_last_owner_frees() -> None:
    bm = BlockManager(4, 2)
    bm.allocate("p", 4)
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p") and bm.num_free_blocks == 2
    bm.free("p")
    assert bm.num_free_blocks == 2  # still referenced by c
    bm.free("c")
    assert bm.num_free_blocks == 4


def test_append_into_shared_partial_block_copies_on_write() -> None:
    bm = BlockManager(6, 4)
    bm.allocate("p", 8)
    bm.fork("p", "c")  # c shares both full blocks
    bm.rollback("c", 2)  # c's second block is now partial and still shared with p
    shared = bm.block_table("c")[1]
    bm.allocate("c", 1)
    assert bm.block_table("c")[1] != shared and bm.block_table("p")[1] == shared
    assert bm.pending_copies == [(shared, bm.block_table("c")[1])]
    bm.check_invariants()
