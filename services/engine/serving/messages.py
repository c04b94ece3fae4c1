"""Every message between the engine-core process and the API fronts, and its wire form.

Transport: one `multiprocessing` connection (a Unix socket pair) per front. Each direction has one
writer, messages are length-prefixed by the connection, the kernel's socket buffer is the bounded queue,
and its file descriptor can be watched by asyncio's `add_reader`. pyzmq (as vLLM uses) would add an I/O
thread per process and a dependency, and buys nothing at our fan-out (a handful of fronts, one core).
Measured with bench/ipc_transport.py on the shared 2-core machine: a 256-output step message costs
50-85 µs of CPU on each side (encode+send, receive+decode+walk), about 0.25 µs per token, on either
transport; the ratio between them swung from 0.75 to 1.46 across runs: no difference worth a dependency.

Flow, named after the pipeline:
- front -> core: a list of commands per message: `AddRequest`, `AbortRequests`, `AbortQuery`,
  `KvEventsSubscribe`, `KvEventsUnsubscribe`.
- core -> front: `EngineReady` once, then `StepOutputs` per step (only this front's requests, stats always),
  `AddRejected` when the core refuses a request, `AbortAnswer` for an `AbortQuery`, `KvEventsSnapshot` for a
  `KvEventsSubscribe`; while the front has a subscriber, each step's prefix-cache changes ride on its
  StepOutputs (a step that changed the cache is always sent), after the snapshot on the same connection.

Requests are named on the wire by a per-front integer handle, not by their id string: a step's outputs
are three arrays (handle, token id, cached prompt tokens), plus one tuple per finished request.
"""

import pickle
from array import array
from dataclasses import dataclass, field

from services.engine.core.interfaces import EngineStats, PromptLogprobs, TokenLogprobs
from services.engine.core.sampling_params import SamplingParams

NO_TOKEN = -1  # in StepOutputs.token_ids: this output carries no token (an abort)


@dataclass(slots=True)
class AddRequest:
    """Admit a request; the core answers with its outputs, or with AddRejected.

    With sampling.n > 1, completion i's outputs carry handle `handle + i` (the front reserves n handles).
    """

    handle: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float


@dataclass(slots=True)
class AbortRequests:
    """Abort these request ids if they are live (idempotent)."""

    request_ids: list[str]


@dataclass(slots=True)
class AbortQuery:
    """The Abort RPC: abort these ids, then these (request id, index) completions, and answer which of them were
    live (any front's requests)."""

    query_id: int
    request_ids: list[str]
    completions: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class EngineReady:
    """The first message on every front's connection: the loaded engine's description."""

    description: object  # services.engine.serving.engine_process.EngineDescription


@dataclass(slots=True)
class FinishedRequest:
    """The final figures of one request (one per request, in the step it finished or was aborted)."""

    handle: int
    finish_reason: int  # services.engine.core.sequence.FinishReason value
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    matched_stop_token_id: int | None
    queue_time_s: float | None = None  # arrival to first scheduled, in the core; None if it never ran
    # With sampling.n > 1 completion i has handle AddRequest.handle + i; one of these per completion.
    request_handle: int = -1  # AddRequest.handle of its request
    request_finished: bool = True  # the request's last completion to finish


@dataclass(slots=True)
class StepLogprobs:
    """The log-probabilities of some of a StepOutputs' tokens, as flat arrays: entry j belongs to the output at
    `positions[j]` and owns the next `top_counts[j]` entries of `top_token_ids` / `top_logprobs`."""

    positions: array  # int64 [M]
    logprobs: array  # float64 [M]
    top_counts: array  # int64 [M]
    top_token_ids: array  # int64 [sum(top_counts)]
    top_logprobs: array  # float64 [sum(top_counts)]

    @classmethod
    def empty(cls) -> "StepLogprobs":
        return cls(array("q"), array("d"), array("q"), array("q"), array("d"))

    def append(self, position: int, logprobs: TokenLogprobs) -> None:
        self.positions.append(position)
        self.logprobs.append(logprobs.logprob)
        self.top_counts.append(len(logprobs.top_token_ids))
        self.top_token_ids.extend(logprobs.top_token_ids)
        self.top_logprobs.extend(logprobs.top_logprobs)

    def unpack(self) -> dict[int, TokenLogprobs]:
        """position -> TokenLogprobs."""
        result, start = {}, 0
        for position, logprob, count in zip(self.positions, self.logprobs, self.top_counts):
            end = start + count
            result[position] = TokenLogprobs(logprob, self.top_token_ids[start:end].tolist(),
                                             self.top_logprobs[start:end].tolist())
            start = end
        return result


@dataclass(slots=True)
class StepOutputs:
    """One engine step's outputs for one front's requests, and the engine's figures after the step.

    `handles[i]` got token `token_ids[i]` (NO_TOKEN for none) with `num_cached_tokens[i]` prompt tokens
    served from the prefix cache; a request finishing in this step also has an entry in `finished`.
    `logprobs` is None unless some request of the step asked for log-probabilities; `prompt_logprobs` maps the
    handle of each output carrying its request's prompt log-probabilities (with its first token) to them.
    """

    handles: array  # int64 [N]
    token_ids: array  # int64 [N]
    num_cached_tokens: array  # int64 [N]
    finished: list[FinishedRequest]
    stats: EngineStats
    num_finished_requests: int  # cumulative, over every front
    # This step's prefix-cache changes while the front has a subscriber: a KvCacheEvents's (block_hashes, cached),
    # as a plain tuple (pickling a class costs more than its bytes).
    kv_events: tuple[bytes, bytes] | None = None
    logprobs: StepLogprobs | None = None
    prompt_logprobs: dict[int, PromptLogprobs] | None = None


@dataclass(slots=True)
class AddRejected:
    """The core refused an AddRequest (duplicate id, full queue, invalid): the front raises `error`."""

    handle: int
    error: Exception


@dataclass(slots=True)
class AbortAnswer:
    """The ids and completions of an AbortQuery that were live and are now aborted."""

    query_id: int
    aborted_request_ids: list[str]
    aborted_completions: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class KvEventsSubscribe:
    """Answer with a KvEventsSnapshot for this subscriber, and send this front every step's cache changes."""

    subscriber_id: int


@dataclass(slots=True)
class KvEventsUnsubscribe:
    """This subscriber is gone; the core stops recording cache changes once no front has any."""

    subscriber_id: int


@dataclass(slots=True)
class KvEventsSnapshot:
    """Every block hash cached when a KvEventsSubscribe was applied; later StepOutputs carry the changes."""

    subscriber_id: int
    block_hashes: array  # uint64 [num cached]


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)
