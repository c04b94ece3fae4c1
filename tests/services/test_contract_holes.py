"""Contract holes found when probed (issue 8, item 5), each closed at the boundary that owns it, in process.

- bytes that do not parse as the method's request (corrupt, invalid UTF-8 in a string) get INVALID_ARGUMENT;
- one request_id rule at both services (length, printable ASCII), and client strings never forge a log line;
- a duplicate in-flight id is INVALID_ARGUMENT with BadRequest("request_id"), as engine.proto documents;
- temperature inf / nan is refused by the engine exactly as by the tokenizer service (one shared rule);
- a prompt that fills max_model_len with max_tokens unset is blamed on the prompt, not on max_tokens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc_status import rpc_status

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from services.common.errors import DuplicateRequestError, InvalidRequestError, QueueFullError
from services.common.grpc_server import ServingState, abort_with, build_server, status_for
from services.common.validation import MAX_REQUEST_ID_LEN
from services.engine.core.request_validator import RequestValidator
from services.engine.serving.convert import sampling_from_proto
from services.engine.serving.server import SERVICE_NAME as ENGINE_SERVICE, EngineServicer
from services.tokenizer.serving.convert import ResolvedRequest
from services.tokenizer.limits import InputLimits
from services.tokenizer.serving.server import SERVICE_NAME as TEXTGEN_SERVICE, TextGenerationServicer

from tests.tokenizer.conftest import text_tokenizer  # noqa: F401 (a fixture)

MARK = b"MARKMARK"


def identity(data: bytes) -> bytes:
    return data


def with_bad_utf8(message) -> bytes:
    """`message`'s bytes with MARK (inside one string field) replaced by invalid UTF-8 of the same length."""
    data = message.SerializeToString()
    assert data.count(MARK) == 1
    return data.replace(MARK, b"\xff\xfe" * (len(MARK) // 2))


def raw_call(target: str, method: str, body: bytes) -> list[bytes] | grpc.RpcError:
    """Send `body` as the request bytes; the response bytes, or the error."""
    async def call() -> list[bytes] | grpc.RpcError:
        async with grpc.aio.insecure_channel(target) as channel:
            stream = channel.unary_stream(method, request_serializer=identity, response_deserializer=identity)
            try:
                return [response async for response in stream(body, timeout=30)]
            except grpc.RpcError as error:
                return error

    return asyncio.run(call())


class EchoEngine(engine_pb2_grpc.EngineServiceServicer):
    async def Generate(self, request, context):
        yield engine_pb2.GenerateResponse(request_id=request.request_id)


MALFORMED = [
    ("text", "/llmserve.textgen.v1.TextGenerationService/Generate",
     with_bad_utf8(textgen_pb2.GenerateRequest(text=MARK.decode()))),
    ("chat content", "/llmserve.textgen.v1.TextGenerationService/Generate",
     with_bad_utf8(textgen_pb2.GenerateRequest(chat={"messages": [{"role": "user", "content": MARK.decode()}]}))),
    ("engine request_id", "/llmserve.engine.v1.EngineService/Generate",
     with_bad_utf8(engine_pb2.GenerateRequest(request_id=MARK.decode(), prompt_token_ids=[1]))),
    ("corrupt body", "/llmserve.engine.v1.EngineService/Generate", b"\x0a\xff\xff\xff\xff\x0f"),
]


@pytest.fixture(scope="module")
def base_servers():
    """Both services' method tables: the engine's echoes the request id; the text service's is unimplemented."""
    loop = asyncio.new_event_loop()

    async def start():
        state = ServingState(ENGINE_SERVICE)

        def register(server):
            engine_pb2_grpc.add_EngineServiceServicer_to_server(EchoEngine(), server)
            textgen_pb2_grpc.add_TextGenerationServiceServicer_to_server(
                textgen_pb2_grpc.TextGenerationServiceServicer(), server)

        server = build_server([ENGINE_SERVICE, TEXTGEN_SERVICE], state, register)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run_until_complete(start())
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


@pytest.mark.parametrize("method, body", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_bytes_that_do_not_parse_get_invalid_argument(base_servers, method, body):
    error = raw_call(base_servers, method, body)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "malformed request" in error.details() and "Error" not in error.details().split(":")[0]
    [detail] = rpc_status.from_call(error).details
    assert detail.Is(error_details_pb2.BadRequest.DESCRIPTOR)


def test_a_request_that_parses_still_reaches_its_method(base_servers):
    body = engine_pb2.GenerateRequest(request_id="ok", prompt_token_ids=[1]).SerializeToString()
    [response] = raw_call(base_servers, "/llmserve.engine.v1.EngineService/Generate", body)
    assert engine_pb2.GenerateResponse.FromString(response).request_id == "ok"


# request_id: one rule at both services

BAD_IDS = [("too long", "x" * (MAX_REQUEST_ID_LEN + 1)), ("newline", "a\nFORGED log line"),
           ("control", "a\x1b[31m"), ("DEL", "a\x7f"), ("non-ASCII", "caf\u00e9")]


async def first_error(stream) -> Exception:
    with pytest.raises(Exception) as caught:
        async for _ in stream:
            pass
    return caught.value


def engine_servicer() -> EngineServicer:
    info = engine_pb2.GetEngineInfoResponse(vocab_size=100, max_model_len=64)
    return EngineServicer(None, info, ServingState(ENGINE_SERVICE), RequestValidator(100, 64, 16, 64))


@pytest.mark.parametrize("request_id", [case[1] for case in BAD_IDS], ids=[case[0] for case in BAD_IDS])
def test_both_services_refuse_a_bad_request_id_before_anything_else(request_id):
    engine_request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1])
    engine_error = asyncio.run(first_error(engine_servicer().Generate(engine_request, None)))
    textgen = TextGenerationServicer(None, None, ServingState(TEXTGEN_SERVICE), limits=InputLimits(8))
    textgen_error = asyncio.run(first_error(_as_stream(textgen.Generate(
        textgen_pb2.GenerateRequest(request_id=request_id, text="hi"), None))))
    for error in (engine_error, textgen_error):
        assert isinstance(error, InvalidRequestError) and error.field == "request_id", error


async def _as_stream(coroutine):
    await coroutine
    yield None


def test_the_longest_allowed_id_still_fits_once_the_tokenizer_service_suffixes_it():
    from services.common.validation import check_request_id

    resolved = ResolvedRequest("y" * MAX_REQUEST_ID_LEN, "text", [1], common_pb2.SamplingParams(), [], True, False)
    engine_id = resolved.engine_request().request_id
    check_request_id(engine_id)
    assert engine_id.startswith("y" * 200) and engine_id != resolved.engine_request().request_id


def test_a_rejection_log_line_escapes_what_the_client_wrote(caplog):
    class Context:
        async def abort_with_status(self, status):
            raise grpc.aio.AbortError()

    error = InvalidRequestError("stop[0]", "bad stop string 'x\nFORGED: admin logged in'")
    with caplog.at_level(logging.INFO, logger="services.common.grpc_server"):
        with pytest.raises(grpc.aio.AbortError):
            asyncio.run(abort_with(Context(), error))
    [record] = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert "\n" not in record.getMessage() and "\\nFORGED" in record.getMessage()


# duplicate in-flight id


def test_a_duplicate_id_is_invalid_argument_naming_request_id_as_the_proto_says():
    status = status_for(DuplicateRequestError("request_id 'a' is already in flight"))
    assert status.code == code_pb2.INVALID_ARGUMENT
    [detail] = status.details
    bad_request = error_details_pb2.BadRequest()
    assert detail.Unpack(bad_request)
    assert [(v.field, v.description) for v in bad_request.field_violations] == \
        [("request_id", "request_id 'a' is already in flight")]


def test_errors_keep_their_fields_across_the_core_to_front_pipe():
    duplicate = pickle.loads(pickle.dumps(DuplicateRequestError("in flight")))
    assert (duplicate.field, duplicate.description, str(duplicate)) == ("request_id", "in flight",
                                                                       "request_id: in flight")
    invalid = pickle.loads(pickle.dumps(InvalidRequestError("sampling.top_p", "too big")))
    assert (invalid.field, invalid.description) == ("sampling.top_p", "too big")
    full = pickle.loads(pickle.dumps(QueueFullError("full", retry_after_s=2.5)))
    assert full.retry_after_s == 2.5


def test_a_retry_delay_of_seconds_is_encoded_whole():
    [detail] = status_for(QueueFullError("full", retry_after_s=2.5)).details
    retry = error_details_pb2.RetryInfo()
    assert detail.Unpack(retry)
    assert retry.retry_delay.ToTimedelta().total_seconds() == 2.5


# sampling values and blame


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_the_engine_refuses_a_temperature_the_tokenizer_service_refuses(temperature, text_tokenizer):
    from services.tokenizer.serving.convert import resolve_sampling

    proto = common_pb2.SamplingParams(temperature=temperature, max_tokens=4)
    with pytest.raises(InvalidRequestError) as engine_error:
        sampling_from_proto(proto, 4, 64)
    with pytest.raises(InvalidRequestError) as tokenizer_error:
        resolve_sampling(proto, text_tokenizer.generation_defaults(), 4, 64, 16, text_tokenizer.vocab_size)
    assert engine_error.value.field == tokenizer_error.value.field == "sampling.temperature"
    assert engine_error.value.description == tokenizer_error.value.description


def test_a_full_context_prompt_without_max_tokens_blames_the_prompt_at_the_engine():
    with pytest.raises(InvalidRequestError) as caught:
        sampling_from_proto(common_pb2.SamplingParams(), num_prompt_tokens=64, max_model_len=64)
    assert caught.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as caught:  # set by the caller: then it is max_tokens' fault
        RequestValidator(100, 64, 16, 64).validate([1] * 64, sampling_from_proto(
            common_pb2.SamplingParams(max_tokens=1), num_prompt_tokens=64, max_model_len=64))
    assert caught.value.field == "sampling.max_tokens"
    assert sampling_from_proto(common_pb2.SamplingParams(), 63, 64).max_tokens == 1


@pytest.mark.parametrize("prompt, field", [(dict(token_ids={"ids": [5] * 64}), "token_ids.ids"),
                                           (dict(text="x"), "text")], ids=["token ids", "text"])
def test_a_full_context_prompt_without_max_tokens_blames_the_prompt_at_the_tokenizer_service(
        text_tokenizer, prompt, field):
    from services.tokenizer.serving.convert import resolve_generate

    request = textgen_pb2.GenerateRequest(**prompt)
    num_prompt_tokens = 64 if field != "text" else len(text_tokenizer.encode("x"))
    with pytest.raises(InvalidRequestError) as caught:
        resolve_generate(request, "r", text_tokenizer, num_prompt_tokens, 256)
    assert caught.value.field == field
