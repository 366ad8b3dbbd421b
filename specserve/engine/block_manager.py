"""Paged KV-cache bookkeeping (PagedAttention, Kwon et al., arXiv 2309.06180).

Each sequence owns a block table: the ids of the fixed-size blocks holding its KV slots, in order.
Blocks are reference counted so that sequences can share a prefix (``fork``); a block returns to the
free pool when its count drops to zero. Speculative decoding writes KV for draft tokens that the verifier
may reject, so the last ``n`` slots of a sequence can be rolled back, releasing blocks left empty.
Appending into a partially filled block that another sequence shares copies it first (copy-on-write):
the copy is queued in ``pending_copies`` as ``(src_block, dst_block)`` for the model runner to perform
before its next forward pass.

    block_size 4, slots 0..9 of a sequence  ->  table [b0, b1, b2], b2 holds slots 8, 9
    rollback(2)                             ->  table [b0, b1], b2 freed
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_slots: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_slots(self, seq_id: str) -> int:
        return self._num_slots.get(seq_id, 0)

    def blocks_needed(self, seq_id: str, num_new_slots: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        total = self._num_slots.get(seq_id, 0) + num_new_slots
        return max(0, -(-total // self.block_size) - have) + int(self._needs_cow(seq_id, num_new_slots))

    def _needs_cow(self, seq_id: str, num_new_slots: int) -> bool:
        table = self._tables.get(seq_id)
        return bool(table and num_new_slots and self._num_slots[seq_id] % self.block_size
                    and self._ref_counts[table[-1]] > 1)

    def can_allocate(self, seq_id: str, num_new_slots: int) -> bool:
        return self.blocks_needed(seq_id, num_new_slots) <= len(self._free)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    # ---- mutations -----------------------------------------------------------------------------
    def allocate(self, seq_id: str, num_new_slots: int) -> None:
        """Reserve ``num_new_slots`` more slots at the end of the sequence."""
        need = self.blocks_needed(seq_id, num_new_slots)
        if need > len(self._free):
            raise NoFreeBlocksError(f"need {need} blocks, {len(self._free)} free")
        if self._needs_cow(seq_id, num_new_slots):
            table = self._tables[seq_id]
            shared = table[-1]
            copy = self._free.popleft()
            self._ref_counts[copy] = 1
            self._ref_counts[shared] -= 1
            table[-1] = copy
            self.pending_copies.append((shared, copy))
            need -= 1
        table = self._tables.setdefault(seq_id, [])
        self._num_slots.setdefault(seq_id, 0)
        for _ in range(need):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)
        self._num_slots[seq_id] += num_new_slots

    def rollback(self, seq_id: str, num_slots: int) -> None:
        """Drop the last ``num_slots`` slots; blocks left empty are released."""
        have = self._num_slots.get(seq_id, 0)
        if not 0 <= num_slots <= have:
            raise ValueError(f"sequence {seq_id}: cannot roll back {num_slots} of {have} slots")
        self._num_slots[seq_id] = have - num_slots
        keep = -(-self._num_slots[seq_id] // self.block_size)
        table = self._tables[seq_id]
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq_id: str) -> None:
        for block in self._tables.pop(seq_id, []):
            self._release(block)
        self._num_slots.pop(seq_id, None)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Share the parent's full blocks with a new child sequence (copy-free prefix sharing).

        The child gets the parent's full blocks only; the parent's partial tail (if any) is not shared, so
        the child starts at the last block boundary and recomputes the tail itself.
        """
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already exists")
        full = self._num_slots.get(parent_id, 0) // self.block_size
        shared = self._tables.get(parent_id, [])[:full]
        for block in shared:
            self._ref_counts[block] += 1
        self._tables[child_id] = list(shared)
        self._num_slots[child_id] = full * self.block_size

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        assert self._ref_counts[block] >= 0, f"block {block} released twice"
        if self._ref_counts[block] == 0:
            self._free.append(block)

    def check_invariants(self) -> None:
        """Every block is either free (count 0) or referenced exactly as often as tables name it."""
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(table) == -(-self._num_slots[seq_id] // self.block_size), seq_id
            for block in table:
                counts[block] += 1
        assert counts == self._ref_counts, "reference counts disagree with block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert free == {b for b in range(self.num_blocks) if counts[b] == 0}, "free list disagrees with counts"
