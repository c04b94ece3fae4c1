"""The relay's pieces: EngineStream coalesces what arrived while the client was busy; a coalesced batch that
completes a stop string is cut at the token that completed it."""

import asyncio

import pytest

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2
from services.tokenizer.serving.engine_client import EngineStream
from services.tokenizer.serving.server import _push, client_logprobs
from services.tokenizer.text_stream import TextStream


class ScriptedCall:
    """An engine call whose messages are released in bursts by the test."""

    def __init__(self):
        self.bursts: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        while (burst := await self.bursts.get()) is not None:
            if isinstance(burst, Exception):
                raise burst
            for message in burst:
                yield message

    def cancel(self) -> None:
        self.cancelled = True


def message(*ids: int, finish: int = common_pb2.FINISH_REASON_UNSPECIFIED, completion_tokens: int = 0):
    return engine_pb2.GenerateResponse(token_ids=ids, finish_reason=finish,
                                       usage=common_pb2.Usage(completion_tokens=completion_tokens))


def test_ids_that_arrive_between_takes_come_out_as_one_batch():
    async def scenario():
        call = ScriptedCall()
        stream = EngineStream(call)
        await call.bursts.put([message(1, completion_tokens=1)])
        first = await stream.take()
        await call.bursts.put([message(2, completion_tokens=2), message(3, 4, completion_tokens=4),
                               message(finish=common_pb2.FINISH_REASON_LENGTH, completion_tokens=4)])
        second = await stream.take()
        await call.bursts.put(None)
        third = await stream.take()
        stream.cancel()
        return first, second, third, call.cancelled

    first, second, third, cancelled = asyncio.run(scenario())
    assert first[0] == [1]
    assert second[0] == [2, 3, 4]
    assert second[1].finish_reason == common_pb2.FINISH_REASON_LENGTH and second[1].usage.completion_tokens == 4
    assert third == ([], None)
    assert cancelled


def test_an_engine_error_reaches_the_taker_after_the_ids_before_it():
    async def scenario():
        call = ScriptedCall()
        stream = EngineStream(call)
        await call.bursts.put([message(7)])
        await call.bursts.put(RuntimeError("engine gone"))
        ids, _ = await stream.take()
        with pytest.raises(RuntimeError, match="engine gone"):
            await stream.take()
        return ids

    assert asyncio.run(scenario()) == [7]


def test_a_batch_that_completes_a_stop_string_ends_at_the_completing_token(text_tokenizer):
    tok = text_tokenizer
    ids = tok.encode(" Hello world and more words", add_special_tokens=False)
    text_stream = TextStream(tok, tok.encode("Say:"), stops=["world"])
    kept, delta, matched = _push(text_stream, ids, has_stops=True)
    assert matched == "world" and delta == " Hello "
    assert tok.decode(kept).endswith("world") and not tok.decode(kept[:-1]).endswith("world")
    assert len(kept) < len(ids)


def test_without_stop_strings_a_batch_is_pushed_whole(text_tokenizer):
    tok = text_tokenizer
    ids = tok.encode(" Hello world", add_special_tokens=False)
    assert _push(TextStream(tok, tok.encode("Say:")), ids, has_stops=False) == (ids, " Hello world", None)


def test_logprobs_are_cut_with_the_ids_and_carry_each_tokens_text(text_tokenizer):
    tok = text_tokenizer
    ids = tok.encode(" Hello world again", add_special_tokens=False)
    engine_logprobs = [common_pb2.PositionLogprobs(sampled=common_pb2.TokenLogprob(token_id=i, logprob=-1.0),
                                                   top=[common_pb2.TokenLogprob(token_id=ids[0], logprob=-0.5)])
                       for i in ids]
    kept = client_logprobs(tok, engine_logprobs, len(ids) - 1)  # a stop string matched before the last id
    assert [p.sampled.token_id for p in kept] == ids[:-1]
    assert [p.sampled.text for p in kept] == [tok.decode([i], skip_special_tokens=False) for i in ids[:-1]]
    assert all(p.top[0].text == tok.decode([ids[0]]) for p in kept)
    assert not engine_logprobs[0].sampled.text  # the engine's messages are left as they were


def test_prompt_logprobs_keep_the_first_entry_empty_and_carry_each_tokens_text(text_tokenizer):
    tok = text_tokenizer
    ids = tok.encode("Hello world", add_special_tokens=False)
    engine_prompt = [common_pb2.PositionLogprobs()] + [
        common_pb2.PositionLogprobs(sampled=common_pb2.TokenLogprob(token_id=i, logprob=-2.0),
                                    top=[common_pb2.TokenLogprob(token_id=ids[0], logprob=-0.5)]) for i in ids[1:]]
    positions = client_logprobs(tok, engine_prompt, len(engine_prompt))
    assert not positions[0].HasField("sampled") and not positions[0].top  # nothing predicts the first token
    assert [p.sampled.text for p in positions[1:]] == [tok.decode([i], skip_special_tokens=False) for i in ids[1:]]
    assert all(p.top[0].text == tok.decode([ids[0]]) for p in positions[1:])


def test_prompt_logprobs_are_taken_once_with_completion_0():
    prompt = [common_pb2.PositionLogprobs(), common_pb2.PositionLogprobs(top=[common_pb2.TokenLogprob(token_id=3)])]

    async def scenario():
        call = ScriptedCall()
        stream = EngineStream(call)
        first = engine_pb2.GenerateResponse(token_ids=[5], index=0, prompt_logprobs=prompt)
        await call.bursts.put([engine_pb2.GenerateResponse(token_ids=[6], index=1), first])
        taken = []
        for _ in range(3):
            await stream.take()
            taken.append(list(stream.take_prompt_logprobs()))
            if len(taken) == 2:
                await call.bursts.put([engine_pb2.GenerateResponse(token_ids=[7], index=0)])
        stream.cancel()
        return taken

    # index 0's first message, then index 1's (nothing), then index 0's second (nothing again)
    assert asyncio.run(scenario()) == [prompt, [], []]
