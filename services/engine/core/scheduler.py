"""Continuous batching: which sequences run in the next step, and what their results mean.

The rules (ARCHITECTURE.md §2): a step is all prefill or all decode; prefill goes first, within
`max_num_seqs` and `max_num_batched_tokens`, chunking only the first sequence of the batch; decode makes
room by preempting the newest running sequence (recomputation, LIFO), down to the sequence itself.

Deliberate refinement of the seed (shared/seed, nano-vllm's chapter): the seed caps each *step* at
`max_num_seqs` but lets `running` grow without bound, so under overload every arrival is prefilled, gets
one token, then starves at the tail of `running` while holding its KV blocks (probed: 48 running, 44 stuck
at one token with max_num_seqs=4). Here a sequence starts prefilling only while fewer than
`max_running = min(max_num_seqs, max_num_batched_tokens)` sequences run or are being prefilled, so
`running` never outgrows one decode step: every running sequence decodes every decode step, and the
others wait in `waiting` without KV (where the waiting bound, `num_queued`, can refuse new ones).
The per-step caps are unchanged.
"""

from collections import deque
from collections.abc import Collection

from services.engine.core.block_manager import BlockManager
from services.engine.core.config import SchedulerConfig
from services.engine.core.interfaces import SchedulerOutput
from services.engine.core.sequence import FinishReason, Sequence, SequenceStatus


class Scheduler:
    """Owns the `waiting` and `running` deques and the block manager.

    `waiting` holds new and preempted sequences, and the one (at its head) whose prefill is being chunked;
    `running` holds fully prefilled sequences in the order they decode.
    """

    def __init__(self, config: SchedulerConfig, eos_token_ids: Collection[int]):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # NOTE: a decode step takes one token per sequence, so the token budget caps it as well.
        self.max_running = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(
            config.num_kvcache_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0
        self.num_computed_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_admitted = 0  # sequences that started prefilling (a preempted one counts again when restarted)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind the waiting ones."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_queued(self) -> int:
        """Waiting sequences never admitted to `running` (the waiting bound's count): all but the preempted ones.

        A new sequence whose prompt is being prefilled in chunks counts until it runs. NOTE: O(len(waiting));
        with a waiting bound, `waiting` holds at most max_waiting such sequences plus the preempted ones
        (fewer than max_running).
        """
        return sum(1 for seq in self.waiting if not seq.num_preemptions)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's batch: prefill when anything can be prefilled, else decode.

        The batch is empty when nothing can run.
        """
        seqs = self._schedule_prefill()
        if seqs:
            return SchedulerOutput(seqs, is_prefill=True)
        return SchedulerOutput(self._schedule_decode(), is_prefill=False)

    def _schedule_prefill(self) -> list[Sequence]:
        seqs: list[Sequence] = []
        num_batched_tokens = 0
        block_manager = self.block_manager
        # Every sequence of a prefill batch runs once its prompt is computed: admit only into free slots.
        max_batch = self.max_running - len(self.running)
        while self.waiting and len(seqs) < max_batch:
            remaining = self.max_num_batched_tokens - num_batched_tokens
            if remaining <= 0:
                break
            seq = self.waiting[0]
            cached_block_ids = None
            if seq.block_table:
                num_new_tokens = seq.num_tokens - seq.num_cached_tokens
            else:
                cached_block_ids = block_manager.cached_prefix(seq)
                if not block_manager.can_allocate(seq, cached_block_ids):
                    break
                num_new_tokens = seq.num_tokens - len(cached_block_ids) * block_manager.block_size
            if num_new_tokens > remaining and seqs:
                break
            if cached_block_ids is not None:
                block_manager.allocate(seq, cached_block_ids)
                self.num_cached_prompt_tokens += seq.num_cached_tokens
                self.num_admitted += 1
            seq.num_scheduled_tokens = min(num_new_tokens, remaining)
            num_batched_tokens += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            seqs.append(seq)
        return seqs

    def _schedule_decode(self) -> list[Sequence]:
        # NOTE: admission keeps len(running) <= max_running; the cap below is a guard, not a rule that binds.
        max_batch = self.max_running
        if len(self.running) <= max_batch:
            seqs = self._decode_all_without_preemption()
            if seqs is not None:
                return seqs
        seqs = []
        while self.running and len(seqs) < max_batch:
            seq = self.running.popleft()
            if not self._make_room(seq):
                continue
            seq.num_scheduled_tokens = 1
            self.block_manager.may_append(seq)
            seqs.append(seq)
        self.running.extendleft(reversed(seqs))
        return seqs

    def _decode_all_without_preemption(self) -> list[Sequence] | None:
        """The common step: every running sequence decodes and the free blocks cover the ones that start a
        new block, so nobody is preempted and `running` keeps its order. None when that does not hold."""
        block_manager = self.block_manager
        block_size = block_manager.block_size
        seqs = list(self.running)
        growing = [seq for seq in seqs if len(seq.block_table) * block_size < len(seq.token_ids)]
        if len(growing) > block_manager.num_free_blocks:
            return None
        for seq in seqs:
            seq.num_scheduled_tokens = 1
        for seq in growing:
            block_manager.may_append(seq)
        return seqs

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt from the tail of `running` until `seq` can append; False if `seq` itself was preempted."""
        while not self.block_manager.can_append(seq):
            if not self.running:
                self.preempt(seq)
                return False
            self.preempt(self.running.pop())
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recomputation: drop all of `seq`'s KV and put it back at the head of `waiting`."""
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Sequence]:
        """Record a step's results; return the sequences that got a new token (finished ones included).

        `sampled_token_ids[i]` belongs to `batch.seqs[i]`; it is ignored (None) for a sequence still
        mid-prefill. A finished sequence frees its blocks and leaves `running`.
        """
        if len(sampled_token_ids) != len(batch.seqs):
            raise RuntimeError(f"runner returned {len(sampled_token_ids)} tokens for {len(batch.seqs)} sequences")
        if batch.is_prefill:
            self.num_computed_prompt_tokens += batch.num_batched_tokens
        block_size = self.block_manager.block_size
        hash_blocks = self.block_manager.hash_blocks
        updated: list[Sequence] = []
        any_finished = False
        for seq, token_id in zip(batch.seqs, sampled_token_ids):
            num_cached_tokens = seq.num_cached_tokens + seq.num_scheduled_tokens
            if num_cached_tokens // block_size != seq.num_cached_tokens // block_size:
                hash_blocks(seq)  # this step filled a block
            seq.num_cached_tokens = num_cached_tokens
            seq.num_scheduled_tokens = 0
            if num_cached_tokens < len(seq.token_ids):
                continue
            if token_id is None:
                raise RuntimeError(f"runner sampled no token for fully computed request {seq.request_id}")
            seq.token_ids.append(token_id)
            finish_reason = self._check_finish(seq, token_id)
            if finish_reason is not None:
                seq.finish_reason = finish_reason
                self._finish(seq)
                any_finished = True
            updated.append(seq)
        self.num_generated_tokens += len(updated)
        if any_finished:
            # NOTE: one pass per step, not a deque.remove per finished sequence.
            survivors = [seq for seq in self.running if seq.status != SequenceStatus.FINISHED]
            self.running.clear()
            self.running.extend(survivors)
        return updated

    def _check_finish(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """STOP on a stop token id or EOS once `min_tokens` tokens precede it; LENGTH at max_tokens/max_model_len.

        NOTE: `min_tokens` counts the tokens before the stop token, as in vLLM: with min_tokens=2 the
        earliest stop is the third completion token.
        """
        sampling = seq.sampling
        num_completion_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        if num_completion_tokens > sampling.min_tokens:
            if token_id in sampling.stop_token_ids:
                seq.matched_stop_token_id = token_id
                return FinishReason.STOP
            if not sampling.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
        if num_completion_tokens >= sampling.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def abort(self, seq: Sequence) -> None:
        """Take `seq` out of whichever queue holds it and free its blocks (between steps, at any stage)."""
        if seq.is_finished:
            return
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
                break
        seq.num_scheduled_tokens = 0
        seq.finish_reason = FinishReason.ABORTED
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)
