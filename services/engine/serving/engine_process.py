"""The engine core's own process: a continuous step loop fed and drained through one connection per front.

The loop, vLLM v1's EngineCore in spirit: take every command that arrived (adds, aborts), step, and send
each front the outputs of its own requests, at once, with no handshake; sleep on the connections only
when there is nothing to step. The fronts (gRPC processes) never wait for a step and the core never
waits for a relay. Nothing here imports grpc.
"""

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time
from array import array
from dataclasses import dataclass

from services.common import logs
from services.common.default_model import model_display_name
from services.common.gc_heap import freeze_startup_heap
from services.engine.core.engine import EngineCore
from services.engine.core.interfaces import RequestOutput
from services.engine.serving.messages import (
    NO_TOKEN, AbortAnswer, AbortQuery, AbortRequests, AddRejected, AddRequest, EngineReady, FinishedRequest,
    KvEventsSnapshot, KvEventsSubscribe, KvEventsUnsubscribe, StepLogprobs, StepOutputs, decode, encode)

logger = logging.getLogger(__name__)
IDLE_POLL_S = 1.0  # while idle, how often the loop looks up from its connections (to notice a dead parent)
STATS_ONLY_INTERVAL_S = 0.05  # how often a front with no outputs still hears the engine's figures while busy


@dataclass(slots=True)
class EngineDescription:
    """What GetEngineInfo reports and what fronts need to validate requests, computed where the model is."""

    fields: dict
    scheduler_config: object
    eos_token_ids: list[int]
    vocab_size: int
    num_total_blocks: int


def describe(llm) -> EngineDescription:
    """The description of a loaded offline engine (services.engine.llm.LLM)."""
    from services.common.fingerprint import tokenizer_fingerprint

    runner, config = llm.runner, llm.engine.config
    fields = dict(
        model_name=model_display_name(runner.model_path), vocab_size=runner.vocab_size, max_model_len=config.max_model_len,
        eos_token_ids=list(llm.eos_token_ids),
        tokenizer_fingerprint=tokenizer_fingerprint(llm.tokenizer) if llm.tokenizer is not None else "",
        block_size=config.block_size, num_total_blocks=config.num_kvcache_blocks, device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."), architecture=runner.model_config.architecture,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching, tensor_parallel_size=llm.args.tensor_parallel_size)
    return EngineDescription(fields, config, list(llm.eos_token_ids), runner.vocab_size,
                             llm.engine.scheduler.block_manager.num_total_blocks)


class CoreLoop:
    """Steps an EngineCore continuously for several fronts, each behind one duplex connection.

    Runs in the engine-core process (`run_engine_core`), or on a thread in tests (with a fake runner).
    Ends when every front has hung up or asked nothing more for good (its connection closed).

    KV-cache events: the core records them only while some front has a subscriber; a KvEventsSubscribe is
    answered between steps with a snapshot, and each later step's changes ride on that front's StepOutputs.
    """

    def __init__(self, core: EngineCore, connections: list, description: EngineDescription):
        self.core = core
        self.connections = list(connections)
        self.description = description
        self._routes: dict[str, tuple[int, int]] = {}  # request id -> (front index, handle)
        self._open = set(range(len(self.connections)))
        self._num_finished_requests = 0
        self._last_stats_sent = [0.0] * len(self.connections)
        self._kv_subscriber_ids: list[set[int]] = [set() for _ in self.connections]  # per front

    def run(self) -> None:
        ready = encode(EngineReady(self.description))
        for front in list(self._open):
            self._send(front, ready)
        while self._open:
            self._take_commands(block=not self.core.has_unfinished_requests())
            if self.core.has_unfinished_requests():
                self._publish(self.core.step())

    # ---- commands in ----

    def _take_commands(self, block: bool) -> None:
        connections = [self.connections[front] for front in self._open]
        ready = mp_connection.wait(connections, timeout=IDLE_POLL_S if block else 0)
        for connection in ready:
            front = self.connections.index(connection)
            try:
                while connection.poll():
                    for command in decode(connection.recv_bytes()):
                        self._apply(front, command)
            except (EOFError, OSError):
                self._hang_up(front)

    def _apply(self, front: int, command) -> None:
        if isinstance(command, AddRequest):
            self._add(front, command)
        elif isinstance(command, AbortRequests):
            for request_id in command.request_ids:
                self._abort(request_id, front)
        elif isinstance(command, AbortQuery):
            aborted = [request_id for request_id in command.request_ids if self._abort(request_id)]
            completions = [(request_id, index) for request_id, index in command.completions
                           if self._abort(request_id, index=index)]
            self._send(front, encode(AbortAnswer(command.query_id, aborted, completions)))
        elif isinstance(command, KvEventsSubscribe):
            self._kv_subscriber_ids[front].add(command.subscriber_id)
            self.core.record_kv_events(True)
            self._send(front, encode(KvEventsSnapshot(command.subscriber_id, self.core.cached_block_hashes())))
        elif isinstance(command, KvEventsUnsubscribe):
            self._kv_subscriber_ids[front].discard(command.subscriber_id)
            self._record_kv_events_while_subscribed()

    def _add(self, front: int, command: AddRequest) -> None:
        try:
            self.core.add_request(command.request_id, command.prompt_token_ids, command.sampling,
                                  command.arrival_time)
        except Exception as exc:  # noqa: BLE001 - typed engine errors go back to the front that asked
            self._send(front, encode(AddRejected(command.handle, exc)))
            return
        self._routes[command.request_id] = (front, command.handle)

    def _abort(self, request_id: str, only_front: int | None = None, index: int | None = None) -> bool:
        """Abort a request (or only its completion `index`) if it runs (and belongs to `only_front`, if given)."""
        route = self._routes.get(request_id)
        if route is None or (only_front is not None and route[0] != only_front):
            return False
        if index is not None:
            return self.core.abort_completion(request_id, index)
        return self.core.abort_request(request_id)

    def _hang_up(self, front: int) -> None:
        """A front went away: abort whatever it had in flight; its outputs have nowhere to go."""
        self._open.discard(front)
        for request_id, (owner, _) in list(self._routes.items()):
            if owner == front:
                self.core.abort_request(request_id)
        self._kv_subscriber_ids[front].clear()
        self._record_kv_events_while_subscribed()

    def _record_kv_events_while_subscribed(self) -> None:
        if not any(self._kv_subscriber_ids):
            self.core.record_kv_events(False)

    # ---- outputs out ----

    def _publish(self, outputs: list[RequestOutput]) -> None:
        per_front: dict[int, tuple[array, array, array, list]] = {}
        logprobs: dict[int, StepLogprobs] = {}
        prompt_logprobs: dict[int, dict] = {}  # front -> handle -> PromptLogprobs
        routes = self._routes
        for output in outputs:
            route = routes.get(output.request_id)
            if route is None:
                continue
            front, handle = route
            handle += output.index
            batch = per_front.get(front)
            if batch is None:
                batch = per_front[front] = (array("q"), array("q"), array("q"), [])
            if output.prompt_logprobs is not None:
                prompt_logprobs.setdefault(front, {})[handle] = output.prompt_logprobs
            new_token_ids = output.new_token_ids
            if len(new_token_ids) > 1:  # a held-back best_of completion, whole (services.engine.core.best_of)
                _append_tokens(batch, output, handle, logprobs, front)
            else:
                if output.logprobs:
                    _step_logprobs(logprobs, front).append(len(batch[0]), output.logprobs[-1])
                batch[0].append(handle)
                batch[1].append(new_token_ids[-1] if new_token_ids else NO_TOKEN)
                batch[2].append(output.num_cached_tokens)
            if output.request_finished:
                del routes[output.request_id]
                self._num_finished_requests += 1
            if output.finish_reason is not None:
                batch[3].append(FinishedRequest(handle, int(output.finish_reason), output.num_prompt_tokens,
                                                output.num_completion_tokens, output.num_cached_tokens,
                                                output.matched_stop_token_id, output.queue_time_s,
                                                route[1], output.request_finished))
        stats = self.core.stats()
        events = self.core.take_kv_events()  # None unless a front subscribes
        kv_events = (events.block_hashes, events.cached) if events else None
        now = time.monotonic()
        idle = not self.core.has_unfinished_requests()
        for front in list(self._open):
            batch = per_front.get(front)
            front_kv_events = kv_events if kv_events is not None and self._kv_subscriber_ids[front] else None
            if batch is None:
                if front_kv_events is None and not idle and now - self._last_stats_sent[front] < STATS_ONLY_INTERVAL_S:
                    continue
                batch = (array("q"), array("q"), array("q"), [])
            self._last_stats_sent[front] = now
            self._send(front, encode(StepOutputs(*batch, stats, self._num_finished_requests, front_kv_events,
                                                 logprobs.get(front), prompt_logprobs.get(front))))

    def _send(self, front: int, data: bytes) -> None:
        try:
            self.connections[front].send_bytes(data)
        except OSError:
            self._hang_up(front)


def _step_logprobs(logprobs: dict[int, StepLogprobs], front: int) -> StepLogprobs:
    step_logprobs = logprobs.get(front)
    if step_logprobs is None:
        step_logprobs = logprobs[front] = StepLogprobs.empty()
    return step_logprobs


def _append_tokens(batch: tuple, output: RequestOutput, handle: int, logprobs: dict[int, StepLogprobs],
                   front: int) -> None:
    """One entry per token of an output that carries several (and their logprobs, when it has them)."""
    if output.logprobs:
        step_logprobs = _step_logprobs(logprobs, front)
        for position, token_logprobs in enumerate(output.logprobs, start=len(batch[0])):
            step_logprobs.append(position, token_logprobs)
    num_tokens = len(output.new_token_ids)
    batch[0].extend([handle] * num_tokens)
    batch[1].extend(output.new_token_ids)
    batch[2].extend([output.num_cached_tokens] * num_tokens)


def run_engine_core(connections: list, engine_kwargs: dict, log_level: str = "INFO", log_format: str = "text") -> None:
    """Entry point of the engine-core process: load the model, then run the CoreLoop until every front is gone."""
    from services.engine.llm import LLM

    _die_with_parent()
    logs.configure(log_level, log_format, label="engine-core")
    # NOTE: Ctrl-C and a group-wide SIGTERM reach this process too; the fronts drain first, then hang up,
    # which ends the loop. A SIGKILL (the out-of-memory killer) is seen by every front as a closed connection.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = LLM(**engine_kwargs)
    except BaseException as exc:  # noqa: BLE001 - every front re-raises it
        failure = encode(EngineReady(RuntimeError(f"engine failed to start: {exc!r}")))
        for connection in connections:
            connection.send_bytes(failure)
        return
    freeze_startup_heap()
    try:
        CoreLoop(llm.engine, connections, describe(llm)).run()
    finally:
        llm.shutdown()
    # NOTE: every front has hung up and nothing is left to clean: skip the interpreter's teardown, which spends
    # seconds in native destructors (no Python frame; measured 5-6 s on the CPU path) while the service's
    # drain waits for this process before exiting.
    logging.shutdown()
    os._exit(0)


def start_engine_core(num_fronts: int, engine_kwargs: dict, log_level: str = "INFO", log_format: str = "text"
                      ) -> tuple[mp.process.BaseProcess, list]:
    """Spawn the engine-core process; return it and the fronts' ends of its connections (one per front)."""
    context = mp.get_context("spawn")
    pairs = [context.Pipe(duplex=True) for _ in range(num_fronts)]
    process = context.Process(target=run_engine_core, name="llmserve-engine-core", daemon=True,
                              args=([core for _, core in pairs], engine_kwargs, log_level, log_format))
    process.start()
    for _, core_end in pairs:
        core_end.close()
    return process, [front_end for front_end, _ in pairs]


def _die_with_parent() -> None:
    """Ask Linux for SIGKILL when the process that started us dies, so no engine outlives its service."""
    if os.uname().sysname == "Linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
