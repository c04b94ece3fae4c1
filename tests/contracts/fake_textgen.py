"""A tiny in-process TextGenerationService for client and CLI tests (sync grpc server on 127.0.0.1, port 0).

Its replies are a pure function of the request (see `fake_reply`), so tests compute what to expect instead of
hard-coding it. Special prompts trigger the error paths; a request id registered with `add_gate` makes Generate
pause after its first message until the test releases it (or the client cancels).
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from llmserve.common.v1 import common_pb2
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc

SERVICE_NAME = "llmserve.textgen.v1.TextGenerationService"
DRAINING_SERVICE = "llmserve.test.Draining"
EOS_ID = 2
BOS_ID = 1
EMPTY_PROMPT_VIOLATION = ("text", "must not be empty")
OVERLOAD_PROMPT = "overload"
OVERLOAD_RETRY_S = 1.5
NO_FINISH_PROMPT = "no finish"
GATE_TIMEOUT_S = 30.0


@dataclass(slots=True)
class FakeReply:
    """What the fake generates: text pieces (one per message), their token ids, and how it ends."""

    pieces: list[str]
    token_ids: list[int]
    finish_reason: int
    matched_stop_token_id: int | None = None
    matched_stop_string: str | None = None


def prompt_words(request: textgen_pb2.GenerateRequest) -> list[str]:
    """The words the fake echoes: the text prompt's, or the last chat message's."""
    if request.WhichOneof("prompt") == "chat":
        return request.chat.messages[-1].content.split()
    return request.text.split()


def fake_reply(request: textgen_pb2.GenerateRequest) -> FakeReply:
    """The prompt's words in reverse order, one word (and one token id) per message, then EOS.

    max_tokens cuts the reply (LENGTH); a word equal to a stop string ends it there (STOP, string left out).
    """
    words = list(reversed(prompt_words(request)))
    stops = set(request.stop)
    limit = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else None
    pieces: list[str] = []
    token_ids: list[int] = []
    for word in words:
        if limit is not None and len(token_ids) == limit:
            return FakeReply(pieces, token_ids, common_pb2.FINISH_REASON_LENGTH)
        token_ids.append(100 + len(token_ids))
        if word in stops:
            pieces.append("")
            return FakeReply(pieces, token_ids, common_pb2.FINISH_REASON_STOP, matched_stop_string=word)
        pieces.append(word + " ")
    if limit is not None and len(token_ids) == limit:
        return FakeReply(pieces, token_ids, common_pb2.FINISH_REASON_LENGTH)
    pieces.append("")
    token_ids.append(EOS_ID)
    return FakeReply(pieces, token_ids, common_pb2.FINISH_REASON_STOP, matched_stop_token_id=EOS_ID)


def fake_logprobs(token_id: int, text: str, num_top: int) -> common_pb2.PositionLogprobs:
    """The sampled token at logprob -0.5, then `num_top` alternatives of ids token_id+k at -0.5-k."""
    sampled = common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, text=text)
    top = [common_pb2.TokenLogprob(token_id=token_id + k, logprob=-0.5 - k, text=f"t{k}") for k in range(num_top)]
    return common_pb2.PositionLogprobs(sampled=sampled, top=top)


def fake_prompt_logprobs(request: textgen_pb2.GenerateRequest) -> list[common_pb2.PositionLogprobs]:
    """One entry per prompt word: the first empty, then word j as token 200+j at -1.5 (fake_logprobs' top)."""
    words = prompt_words(request)
    return [common_pb2.PositionLogprobs()] + [
        common_pb2.PositionLogprobs(sampled=common_pb2.TokenLogprob(token_id=200 + j, logprob=-1.5, text=word),
                                    top=fake_logprobs(200 + j, word, request.sampling.num_prompt_logprobs).top)
        for j, word in enumerate(words[1:], start=1)]


def _n_completions(request_id: str, reply: FakeReply, n: int):
    """Completion i is the reply with "#i" after each word; each position's messages come last index first."""
    for position, piece in enumerate(reply.pieces):
        for index in reversed(range(n)):
            response = textgen_pb2.GenerateResponse(request_id=request_id, index=index,
                                                    text=piece.replace(" ", f"#{index} "))
            response.token_ids.append(reply.token_ids[position])
            if position == len(reply.pieces) - 1:
                response.finish_reason = reply.finish_reason
            yield response


def _abort(context: grpc.ServicerContext, code: int, message: str, *details: object) -> None:
    status = status_pb2.Status(code=code, message=message)
    for detail in details:
        status.details.add().Pack(detail)
    context.abort_with_status(rpc_status.to_status(status))


@dataclass
class FakeTextGeneration(textgen_pb2_grpc.TextGenerationServiceServicer):
    """Records every request; replies with `fake_reply`."""

    requests: list[object] = field(default_factory=list)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    cancelled: dict[str, threading.Event] = field(default_factory=dict)

    def add_gate(self, request_id: str) -> threading.Event:
        """Make the request with this id pause after its first message until the returned event is set."""
        self.cancelled[request_id] = threading.Event()
        gate = self.gates[request_id] = threading.Event()
        return gate

    def Generate(self, request, context):
        self.requests.append(request)
        if request.WhichOneof("prompt") == "text" and not request.text:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=EMPTY_PROMPT_VIOLATION[0], description=EMPTY_PROMPT_VIOLATION[1]
            )
            bad_request = error_details_pb2.BadRequest(field_violations=[violation])
            _abort(context, code_pb2.INVALID_ARGUMENT, "invalid request", bad_request)
        if request.text == OVERLOAD_PROMPT:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(OVERLOAD_RETRY_S * 1e9))
            retry_info = error_details_pb2.RetryInfo(retry_delay=delay)
            _abort(context, code_pb2.RESOURCE_EXHAUSTED, "queue is full", retry_info)
        request_id = request.request_id or "fake-1"
        done = self._watch(request_id, context)
        reply = fake_reply(request)
        if request.text == NO_FINISH_PROMPT:
            yield textgen_pb2.GenerateResponse(request_id=request_id, text=reply.pieces[0])
            return
        num_prompt = len(prompt_words(request))
        if request.sampling.n > 1:
            yield from _n_completions(request_id, reply, request.sampling.n)
            done.set()
            return
        for index, piece in enumerate(reply.pieces):
            last = index == len(reply.pieces) - 1
            response = textgen_pb2.GenerateResponse(request_id=request_id, text=piece)
            response.token_ids.append(reply.token_ids[index])
            response.usage.prompt_tokens = num_prompt
            response.usage.completion_tokens = index + 1
            if request.sampling.HasField("num_logprobs"):
                response.logprobs.append(fake_logprobs(reply.token_ids[index], piece, request.sampling.num_logprobs))
            if index == 0 and request.sampling.HasField("num_prompt_logprobs"):
                response.prompt_logprobs.extend(fake_prompt_logprobs(request))
            if last:
                response.finish_reason = reply.finish_reason
                if reply.matched_stop_token_id is not None:
                    response.matched_stop_token_id = reply.matched_stop_token_id
                if reply.matched_stop_string is not None:
                    response.matched_stop_string = reply.matched_stop_string
                response.timing.total_duration.FromMilliseconds(5)
            yield response
            if index == 0 and request_id in self.gates:
                self.gates[request_id].wait(GATE_TIMEOUT_S)
        done.set()

    def _watch(self, request_id: str, context: grpc.ServicerContext) -> threading.Event:
        """For a gated request: when the RPC ends before `done` is set, record a cancel and open the gate."""
        done = threading.Event()
        if request_id not in self.gates:
            return done
        gate, cancelled = self.gates[request_id], self.cancelled[request_id]

        def on_end() -> None:
            if not done.is_set():
                cancelled.set()
            gate.set()

        if not context.add_callback(on_end):
            on_end()  # the RPC has already ended
        return done

    def Tokenize(self, request, context):
        self.requests.append(request)
        ids = [ord(char) for char in request.text]
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        tokens = list(request.text)
        if add_special:
            ids.insert(0, BOS_ID)
            tokens.insert(0, "<s>")
        return textgen_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    def Detokenize(self, request, context):
        self.requests.append(request)
        return textgen_pb2.DetokenizeResponse(text="".join(chr(token_id) for token_id in request.token_ids))

    def GetModelInfo(self, request, context):
        response = textgen_pb2.GetModelInfoResponse(
            model_name="fake-model", architecture="llama", vocab_size=49152, max_model_len=2048,
            eos_token_ids=[EOS_ID], bos_token_id=BOS_ID, has_chat_template=True,
        )
        response.default_sampling.temperature = 0.5
        response.default_sampling.max_tokens = 256
        return response


def start_server() -> tuple[grpc.Server, int, FakeTextGeneration]:
    """Start the fake plus grpc.health.v1 on 127.0.0.1:0; returns (server, port, servicer)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = FakeTextGeneration()
    textgen_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(DRAINING_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, servicer
