"""One completion of an n > 1 request aborted across the process boundary and through both services, and
best_of's whole completions crossing the core -> front pipe.

The real EngineCore steps in a CoreLoop thread behind real pipes (tests/services/test_async_engine.Harness) with a
fake runner whose steps the test releases; the engine and tokenizer servicers are real grpc.aio servers on
127.0.0.1:0. Gated on events and step permits, never on the clock. NOTE: the core takes commands only between
steps, and a step waits for its permit inside the runner: an abort sent while the core waits is applied once
the test releases that step (so the aborted completion samples once more), never later.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import grpc
import pytest

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve.textgen.v1 import textgen_pb2, textgen_pb2_grpc
from services.common.grpc_server import ServingState, build_server
from services.engine.core.interfaces import SchedulerOutput, TokenLogprobs
from services.engine.core.request_validator import RequestValidator
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason
from services.engine.serving.server import SERVICE_NAME as ENGINE_SERVICE, EngineServicer
from services.tokenizer.serving.engine_client import EngineClient
from services.tokenizer.serving.server import SERVICE_NAME as TEXTGEN_SERVICE, TextGenerationServicer
from services.tokenizer.tokenizer import TextTokenizer
from tests.services.test_async_engine import EOS_ID, STEP_TIMEOUT_S, VOCAB_SIZE, GatedRunner, harness, run, until
from tests.tokenizer.helpers import build_tiny_tokenizer_dir

PROMPT = list(range(3, 13))  # word ids of the tiny tokenizer: 2 full blocks + 2 tokens
MAX_TOKENS = 8
FIRST_WORD = {0: 5, 1: 12}  # completion i samples word id FIRST_WORD[i] + k at sample index k (w3.., w10..)


class CompletionRunner(GatedRunner):
    """GatedRunner whose tokens depend on the completion index; the sampled token's logprob is -(index + 1) when
    a sequence asks for logprobs, so a higher index ranks lower."""

    def __init__(self):
        super().__init__()
        self.samples: Counter[int] = Counter()  # completion index -> tokens sampled
        self.batches: list[list[int]] = []  # per step begun: the completion indices in its batch
        self._logprobs: dict[int, TokenLogprobs] = {}

    def execute(self, batch: SchedulerOutput) -> list[int | None]:
        self.batches.append([seq.index for seq in batch.seqs])
        if not self._open.is_set() and not self._permits.acquire(timeout=STEP_TIMEOUT_S):
            raise TimeoutError("the test released no step")
        sampled, self._logprobs = [], {}
        for seq in batch.seqs:
            if seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                sampled.append(None)
                continue
            self.samples[seq.index] += 1
            if seq.sampling.num_logprobs is not None:
                self._logprobs[seq.seq_id] = TokenLogprobs(-(seq.index + 1.0), [], [])
            sampled.append(FIRST_WORD.get(seq.index, 20) + seq.num_completion_tokens)
        return sampled

    def take_logprobs(self) -> dict[int, TokenLogprobs]:
        return self._logprobs


@contextlib.asynccontextmanager
async def engine_service(runner: CompletionRunner):
    """(harness, engine stub address) of a real EngineServicer over the CoreLoop harness."""
    async with harness(runner, num_blocks=32) as h:
        info = engine_pb2.GetEngineInfoResponse(model_name="fake", vocab_size=VOCAB_SIZE, max_model_len=64,
                                                eos_token_ids=[EOS_ID], block_size=4, num_total_blocks=32)
        state = ServingState(ENGINE_SERVICE)
        servicer = EngineServicer(h.engine, info, state,
                                  RequestValidator.for_config(h.description.scheduler_config, VOCAB_SIZE))
        server = build_server([ENGINE_SERVICE], state, servicer.register)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            yield h, f"127.0.0.1:{port}"
        finally:
            runner.open()
            await server.stop(None)


async def read_to_end(call) -> list:
    """The rest of a stream read with read() (grpc.aio forbids mixing it with iteration)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def greedy_n(n: int, **extra) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=n, **extra)


def test_the_abort_rpc_ends_one_completion_and_its_siblings_go_on():
    async def scenario() -> None:
        runner = CompletionRunner()
        async with engine_service(runner) as (h, target), grpc.aio.insecure_channel(target) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            call = stub.Generate(engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=PROMPT,
                                                            sampling=greedy_n(3)))
            runner.release(3)  # completion 0's prefill, the siblings' prefill, one decode step
            seen = []
            while {r.index for r in seen} != {0, 1, 2}:
                seen.append(await call.read())
            refs = [engine_pb2.CompletionRef(request_id="r", index=index) for index in (1, 7)]
            refs.append(engine_pb2.CompletionRef(request_id="nobody", index=0))
            abort = asyncio.ensure_future(stub.Abort(engine_pb2.AbortRequest(completions=refs)))
            await until(lambda: h.core_ends[0].poll(), "the abort to reach the core")
            runner.release(1)  # the step under way ends; the core applies the abort before the next one
            answer = await abort
            assert [(c.request_id, c.index) for c in answer.aborted_completions] == [("r", 1)]
            assert list(answer.aborted_request_ids) == []
            samples_at_abort = runner.samples[1]
            runner.open()
            responses = seen + await read_to_end(call)
            finals = {r.index: r for r in responses if r.finish_reason}
            assert finals[1].finish_reason == common_pb2.FINISH_REASON_ABORTED
            assert finals[0].finish_reason == finals[2].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert finals[0].usage.completion_tokens == finals[2].usage.completion_tokens == MAX_TOKENS
            assert runner.samples[1] == samples_at_abort < MAX_TOKENS
            again = await stub.Abort(engine_pb2.AbortRequest(completions=refs[:1]))
            assert list(again.aborted_completions) == []  # idempotent

    run(scenario())


def test_best_of_completions_cross_the_pipe_whole_with_their_logprobs():
    async def scenario() -> None:
        runner = CompletionRunner()
        runner.open()
        async with harness(runner, num_blocks=32) as h:
            sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2, best_of=3, num_logprobs=0)
            outputs = [o async for o in h.engine.generate("r", PROMPT, sampling)]
        assert [o.index for o in outputs] == [0, 1]
        assert [o.new_token_ids for o in outputs] == [[FIRST_WORD[i] + k for k in range(MAX_TOKENS)] for i in (0, 1)]
        assert [[p.logprob for p in o.logprobs] for o in outputs] == [[-1.0] * MAX_TOKENS, [-2.0] * MAX_TOKENS]
        assert [o.finish_reason for o in outputs] == [FinishReason.LENGTH] * 2
        assert runner.samples[2] == MAX_TOKENS  # the third was generated, and ranked last

    run(scenario())


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> TextTokenizer:
    words = [f"w{i}" for i in range(30)]  # w0 is id 2 (the harness's EOS): the runner never samples it
    return TextTokenizer.load(build_tiny_tokenizer_dir(tmp_path_factory.mktemp("words"), words))


def test_a_stop_string_in_one_completion_aborts_it_in_the_engine(word_tokenizer):
    async def scenario() -> None:
        runner = CompletionRunner()
        async with engine_service(runner) as (h, engine_target):
            client = EngineClient(engine_target, word_tokenizer.fingerprint())
            assert await client.check()
            state = ServingState(TEXTGEN_SERVICE)
            server = build_server([TEXTGEN_SERVICE], state, TextGenerationServicer(word_tokenizer, client, state).register)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = textgen_pb2_grpc.TextGenerationServiceStub(channel)
                    request = textgen_pb2.GenerateRequest(token_ids={"ids": PROMPT}, sampling=greedy_n(2),
                                                          stop=["w4"])  # completion 0's 2nd word; never in 1's
                    call = stub.Generate(request)
                    runner.release(3)  # completion 0's prefill, completion 1's prefill, one decode: w3 w4
                    # NOTE: poll() is only the abort's sign once the core has read the request and stepped.
                    await until(lambda: len(runner.batches) == 4, "the core to begin a 4th step")
                    # The abort reached the core before it began that step (rare: the core lost the race to w4's
                    # round trip), or it waits in the pipe until the step under way (completion 0's 3rd token) ends.
                    aborted_before_step_4 = 0 not in runner.batches[3]
                    if not aborted_before_step_4:
                        await until(lambda: h.core_ends[0].poll(), "the tokenizer service's abort to reach the core")
                    runner.release(1)
                    responses = []
                    while not any(r.index == 0 and r.finish_reason for r in responses):
                        responses.append(await call.read())
                    # NOTE: the tokenizer service aborts the completion before writing its final message, and no
                    # step runs without a permit: completion 0 sampled exactly 3 (or 2) tokens in the engine.
                    runner.open()
                    responses += await read_to_end(call)
            finally:
                await server.stop(None)
                await client.close()
        finals = {r.index: r for r in responses if r.finish_reason}
        assert finals[0].finish_reason == common_pb2.FINISH_REASON_STOP and finals[0].matched_stop_string == "w4"
        assert finals[1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert "".join(r.text for r in responses if r.index == 1).split() == [f"w{10 + k}" for k in range(MAX_TOKENS)]
        assert runner.samples[0] == (2 if aborted_before_step_4 else 3) and runner.samples[1] == MAX_TOKENS

    run(scenario())


# best_of at both services' boundaries


@pytest.mark.parametrize("n, best_of", [(2, 1), (1, 17)])
def test_both_services_refuse_a_best_of_out_of_range_naming_the_field(n, best_of, word_tokenizer):
    from services.common.errors import InvalidRequestError
    from services.engine.serving.convert import sampling_from_proto
    from services.tokenizer.serving.convert import resolve_sampling

    proto = common_pb2.SamplingParams(max_tokens=4, n=n, best_of=best_of)
    with pytest.raises(InvalidRequestError) as engine_error:
        sampling_from_proto(proto, 4, 64)
    with pytest.raises(InvalidRequestError) as tokenizer_error:
        resolve_sampling(proto, {}, 4, 64, 16, word_tokenizer.vocab_size)
    assert engine_error.value.field == tokenizer_error.value.field == "sampling.best_of"


def test_the_engine_service_reads_best_of_and_leaves_it_unset_by_default():
    from services.engine.serving.convert import sampling_from_proto

    assert sampling_from_proto(common_pb2.SamplingParams(max_tokens=4, n=2, best_of=5), 4, 64).best_of == 5
    assert sampling_from_proto(common_pb2.SamplingParams(max_tokens=4, n=2), 4, 64).best_of is None
