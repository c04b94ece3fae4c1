"""The runner's persistent copy of every live sequence's block table, updated incrementally.

One row per sequence that holds KV blocks; a step writes only the block ids appended since the last step
(one id per sequence every block_size decode steps), not the whole table from Python lists.
"""

import numpy as np
import torch

from services.engine.core.sequence import Sequence, SequenceStatus


class PersistentBlockTables:
    """Rows [num_rows, max_blocks_per_seq] int32 on the host, zero past each row's blocks.

    NOTE: the block manager replaces `seq.block_table` with a new list whenever it (de)allocates a sequence
    (first admission, preemption, finish, abort) and only appends to it while the sequence holds its blocks.
    So a row stays valid while it mirrors the very same list object: any other list means the sequence was
    preempted and re-admitted, and its row is rewritten whole. Rows of finished or preempted sequences are
    reclaimed lazily, when no row is free.
    """

    def __init__(self, max_blocks_per_seq: int, num_rows: int, pin_memory: bool = False):
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pin_memory = pin_memory
        self.tensor = torch.zeros(max(1, num_rows), max_blocks_per_seq, dtype=torch.int32, pin_memory=pin_memory)
        self.array = self.tensor.numpy()  # a view: numpy writes land in the (pinned) tensor
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.row_seqs: list[Sequence | None] = [None] * len(self.array)
        self.row_lists: list[list[int] | None] = [None] * len(self.array)
        self.num_filled = [0] * len(self.array)
        self.free_rows = list(range(len(self.array) - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return len(self.array)

    def rows_for(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row, after bringing every row up to date with its sequence's block table."""
        rows: list[int] = []
        row_of, row_lists, num_filled, array = self.row_of, self.row_lists, self.num_filled, self.array
        for seq in seqs:
            block_table = seq.block_table
            row = row_of.get(seq.seq_id)
            if row is None or row_lists[row] is not block_table:
                row = self._assign(seq) if row is None else row
                self._rewrite(row, seq)
            elif len(block_table) > num_filled[row]:
                start = num_filled[row]
                array[row, start:len(block_table)] = block_table[start:]
                num_filled[row] = len(block_table)
            rows.append(row)
        return rows

    def release(self, seq_id: int) -> None:
        """Free a sequence's row now (optional: rows are also reclaimed lazily)."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self._clear(row)

    def _rewrite(self, row: int, seq: Sequence) -> None:
        block_table = seq.block_table
        if len(block_table) > self.max_blocks_per_seq:
            raise ValueError(f"request {seq.request_id} holds {len(block_table)} blocks; a row holds "
                             f"{self.max_blocks_per_seq}")
        num_blocks = len(block_table)
        self.array[row, :num_blocks] = block_table
        self.array[row, num_blocks:max(num_blocks, self.num_filled[row])] = 0
        self.num_filled[row] = num_blocks
        self.row_seqs[row] = seq
        self.row_lists[row] = block_table

    def _assign(self, seq: Sequence) -> int:
        if not self.free_rows:
            self._reclaim()
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.row_of[seq.seq_id] = row
        return row

    def _reclaim(self) -> None:
        """Free the rows of sequences that finished, or lost their blocks to preemption."""
        for seq_id, row in list(self.row_of.items()):
            seq = self.row_seqs[row]
            if seq.status == SequenceStatus.FINISHED or self.row_lists[row] is not seq.block_table:
                del self.row_of[seq_id]
                self._clear(row)

    def _clear(self, row: int) -> None:
        self.array[row, :self.num_filled[row]] = 0
        self.num_filled[row] = 0
        self.row_seqs[row] = None
        self.row_lists[row] = None
        self.free_rows.append(row)

    def _grow(self) -> None:
        old_rows = self.num_rows
        tensor = torch.zeros(2 * old_rows, self.max_blocks_per_seq, dtype=torch.int32, pin_memory=self.pin_memory)
        tensor[:old_rows] = self.tensor
        self.tensor, self.array = tensor, tensor.numpy()
        self.row_seqs += [None] * old_rows
        self.row_lists += [None] * old_rows
        self.num_filled += [0] * old_rows
        self.free_rows.extend(range(2 * old_rows - 1, old_rows - 1, -1))

    def gather(self, rows: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
        """The first `width` columns of `rows` into `out` [len(rows), width] (the batch's block tables)."""
        np.take(self.array[:, :width], rows, axis=0, out=out)
        return out
