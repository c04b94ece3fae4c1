"""EngineCore: admission, abort and the step loop `schedule -> execute -> postprocess`.

No threads here: the server (or the offline LLM) calls `step()` from one thread of its own, and
`add_request` / `abort_request` between steps on that same thread.
"""

import dataclasses
import itertools
import time
from array import array
from collections.abc import Collection

from services.engine.core.admission import AdmissionRate
from services.engine.core.best_of import BestOfSelector
from services.engine.core.config import SchedulerConfig
from services.engine.core.block_manager import KvCacheEvents
from services.engine.core.errors import DuplicateRequestError, QueueFullError
from services.engine.core.interfaces import EngineStats, ModelRunner, RequestOutput
from services.engine.core.prompt_logprobs import gather_prompt_logprobs, pop_prompt_logprobs
from services.engine.core.request_validator import RequestValidator
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.scheduler import Scheduler
from services.engine.core.sequence import FinishReason, Sequence


class EngineCore:
    """Validates and admits requests, steps the scheduler and model runner, reports per-request progress."""

    def __init__(
        self,
        config: SchedulerConfig,
        runner: ModelRunner,
        eos_token_ids: Collection[int],
        vocab_size: int,
    ):
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.config = config
        self.runner = runner
        self.scheduler = Scheduler(config, eos_token_ids)
        self.validator = RequestValidator.for_config(config, vocab_size)
        # request id -> its unfinished completions (sampling.n sequences, one per index)
        self._live: dict[str, list[Sequence]] = {}
        # request id -> completions 1..n-1 not yet given to the scheduler: they wait until completion 0's prompt
        # is computed, then hit the prefix cache for every full prompt block (prefill once, share the KV blocks)
        self._siblings: dict[str, list[Sequence]] = {}
        self._aborted: list[tuple[Sequence, bool]] = []  # aborted completions to report; True: it ended its request
        self._best_of = BestOfSelector()  # best_of > n requests, whose outputs wait until all completions finished
        self._seq_ids = itertools.count()
        self._admission_rate = AdmissionRate()
        self._take_logprobs = getattr(runner, "take_logprobs", None)  # optional (see interfaces.ModelRunner)
        self._take_prompt_logprobs = getattr(runner, "take_prompt_logprobs", None)  # optional, likewise

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Admit a request to the waiting queue.

        Raises InvalidRequestError when it can never run as given (a structured-output constraint that does not
        compile included), DuplicateRequestError when `request_id` is still in use (until its final output is
        returned), QueueFullError when `max_waiting` requests already wait to be admitted (preempted ones do not count: they were admitted).
        """
        self.validate_request(prompt_token_ids, sampling)
        if sampling.constraint is not None:
            self.runner.compile_grammar(sampling)  # an invalid grammar is rejected here, before it is queued
        if request_id in self._live or any(seq.request_id == request_id for seq, _ in self._aborted):
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        if self.config.max_waiting > 0:
            num_queued = self.scheduler.num_queued
            if num_queued >= self.config.max_waiting:
                delay_s = self._admission_rate.retry_delay_s(num_queued, time.monotonic())
                raise QueueFullError(f"waiting queue is full ({num_queued} requests)", retry_after_s=delay_s)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(seq_id=next(self._seq_ids), request_id=request_id, token_ids=list(prompt_token_ids),
                         sampling=child, arrival_time=arrival, index=index)
                for index, child in enumerate(_completion_params(sampling))]
        self._live[request_id] = seqs
        if len(seqs) > sampling.n:
            self._best_of.hold(request_id, sampling.n, keep_logprobs=sampling.num_logprobs is not None)
        self.scheduler.add(seqs[0])
        if len(seqs) > 1 and self.config.enable_prefix_caching:
            self._siblings[request_id] = seqs[1:]  # admitted once seqs[0]'s prompt is cached (see step)
        else:
            for seq in seqs[1:]:
                self.scheduler.add(seq)

    def validate_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequestError if this request could never run as given (see RequestValidator).

        Reads only configuration, so other threads may call it while the engine steps.
        """
        self.validator.validate(prompt_token_ids, sampling)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; the next step() reports it ABORTED.

        Idempotent: returns True only if the request was live.
        """
        seqs = self._live.pop(request_id, None)
        if seqs is None:
            return False
        self._siblings.pop(request_id, None)
        for position, seq in enumerate(seqs):  # NOTE: Scheduler.abort also ends a sibling never queued (no blocks)
            self.scheduler.abort(seq)
            self._aborted.append((seq, position == len(seqs) - 1))
        return True

    def abort_completion(self, request_id: str, index: int) -> bool:
        """Stop one completion (sampling.n > 1) now and free its blocks; the next step() reports it ABORTED while
        its siblings go on. Blocks it shares with them (the prompt's) only lose its reference.

        Idempotent: returns True only if that completion was live. A best_of > n request has no reportable
        completion before all have finished, so its completions are not aborted one by one (False).
        """
        seqs = self._live.get(request_id)
        if seqs is None or self._best_of.holds(request_id):
            return False
        seq = next((seq for seq in seqs if seq.index == index), None)
        if seq is None:
            return False
        if len(seqs) == 1:
            return self.abort_request(request_id)
        seqs.remove(seq)
        self._replace_in_siblings(request_id, seq)
        self.scheduler.abort(seq)
        self._aborted.append((seq, False))
        return True

    def _replace_in_siblings(self, request_id: str, seq: Sequence) -> None:
        """Keep the siblings' wait right when `seq` goes: a waiting sibling just leaves; when the one computing
        the prompt goes, the next sibling is queued to compute it instead (the rest wait for that one)."""
        waiting = self._siblings.get(request_id)
        if not waiting:
            return
        if seq in waiting:
            waiting.remove(seq)
        else:
            self.scheduler.add(waiting.pop(0))
        if not waiting:
            del self._siblings[request_id]

    def step(self) -> list[RequestOutput]:
        """Run one engine step; one output per request that got a token, finished or was aborted.

        A finished request leaves `_live` here, so its id is free again once its final output is returned.
        """
        outputs = [_output_of(seq, [], request_finished=request_finished) for seq, request_finished in self._aborted]
        self._aborted.clear()
        num_admitted = self.scheduler.num_admitted
        batch = self.scheduler.schedule()
        if batch.is_prefill:
            _mark_scheduled(batch.seqs)
        if self.scheduler.num_admitted != num_admitted:
            self._admission_rate.record(self.scheduler.num_admitted - num_admitted, time.monotonic())
        if batch.seqs:
            sampled_token_ids = self.runner.execute(batch)
            logprobs = self._take_logprobs() if self._take_logprobs is not None else None
            if batch.is_prefill and self._take_prompt_logprobs is not None:
                gather_prompt_logprobs(batch.seqs, self._take_prompt_logprobs())
            for seq in self.scheduler.postprocess(batch, sampled_token_ids):
                self._admit_siblings(seq.request_id)
                request_finished = seq.is_finished and self._retire(seq)
                position = logprobs.get(seq.seq_id) if logprobs else None
                outputs.append(_output_of(seq, [seq.last_token_id], None if position is None else [position],
                                          request_finished))
                if seq.sampling.num_prompt_logprobs is not None:
                    outputs[-1].prompt_logprobs = pop_prompt_logprobs(seq)
        return self._best_of.select(outputs) if self._best_of else outputs

    def _admit_siblings(self, request_id: str) -> None:
        """Give a request's waiting completions to the scheduler: its first sampled a token, so the prompt's
        full blocks are in the prefix cache (a finished first frees its blocks but the cache keeps them)."""
        waiting = self._siblings.pop(request_id, None)
        for seq in waiting or ():
            self.scheduler.add(seq)

    def _retire(self, seq: Sequence) -> bool:
        """Drop a finished completion from `_live`; True when it was its request's last one (the id is free)."""
        seqs = self._live[seq.request_id]
        seqs.remove(seq)
        if seqs:
            return False
        del self._live[seq.request_id]
        return True

    def record_kv_events(self, enabled: bool) -> None:
        """Record the prefix cache's changes from now on (for take_kv_events), or stop; off by default (free)."""
        self.scheduler.block_manager.record_events(enabled)

    def take_kv_events(self) -> KvCacheEvents | None:
        """The prefix cache's changes since the last call, None when not recording.

        NOTE: only step() changes the cache (abort frees blocks but keeps their hashes), so taken after each
        step, these are exactly that step's changes, and a snapshot taken between steps misses nothing.
        """
        return self.scheduler.block_manager.take_events()

    def cached_block_hashes(self) -> array:
        """Every block hash in the prefix cache now: uint64 [num cached]."""
        return self.scheduler.block_manager.cached_block_hashes()

    def has_unfinished_requests(self) -> bool:
        """True while any request runs, waits, or still owes its final (aborted) output."""
        return bool(self._live or self._aborted)

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        block_manager = scheduler.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_used_blocks=block_manager.num_used_blocks,
            num_free_blocks=block_manager.num_free_blocks,
            num_total_blocks=block_manager.num_total_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_cached_prompt_tokens=scheduler.num_cached_prompt_tokens,
            num_computed_prompt_tokens=scheduler.num_computed_prompt_tokens,
            num_generated_tokens=scheduler.num_generated_tokens,
        )


def _completion_params(sampling: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per generated completion (n=1 each; best_of of them when set): completion i draws with
    seed + i when seeded. best_of > n ranks by the sampled tokens' logprobs, so it asks for them (num_logprobs 0:
    the sampled token's only) when the request did not."""
    num_generated = sampling.num_generated
    if num_generated == 1:
        return [sampling]
    num_logprobs = sampling.num_logprobs
    if num_generated > sampling.n and num_logprobs is None:
        num_logprobs = 0
    return [dataclasses.replace(sampling, n=1, best_of=None, num_logprobs=num_logprobs,
                                seed=None if sampling.seed is None else sampling.seed + index)
            for index in range(num_generated)]


def _output_of(seq: Sequence, new_token_ids: list[int], logprobs: list | None = None,
               request_finished: bool = False) -> RequestOutput:
    """A sequence's progress as one step output. NOTE: matched_stop_token_id is set exactly when the finish
    reason is STOP, to the EOS or stop token id that ended it (always the last generated token)."""
    stopped = seq.finish_reason == FinishReason.STOP
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_completion_tokens=seq.num_completion_tokens,
        num_cached_tokens=seq.num_prefix_hit_tokens,
        matched_stop_token_id=seq.last_token_id if stopped else None,
        queue_time_s=_queue_time(seq) if seq.finish_reason is not None else None,
        logprobs=logprobs,
        index=seq.index,
        request_finished=request_finished,
    )


def _mark_scheduled(seqs: list[Sequence]) -> None:
    now = None
    for seq in seqs:
        if seq.first_scheduled_time is None:
            now = now or time.monotonic()
            seq.first_scheduled_time = now


def _queue_time(seq: Sequence) -> float | None:
    """Seconds from arrival to the first scheduling (vLLM's queue interval); None if it never ran."""
    return None if seq.first_scheduled_time is None else max(seq.first_scheduled_time - seq.arrival_time, 0.0)
