"""SubscribeKvEvents on the real engine service (tiny checkpoint, two API fronts): a router hashing a prompt
with services.common.block_hash finds exactly the hashes the engine reports for it, and a drain ends the
subscriptions at once instead of holding the service until its grace period ends.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2, engine_pb2_grpc
from services.common.block_hash import prompt_block_hashes
from tests.services.test_engine_processes import (  # noqa: F401 - tiny_checkpoint is a fixture
    CALL_TIMEOUT_S, EXIT_TIMEOUT_S, start_tiny_engine, tiny_checkpoint)

NUM_SUBSCRIBERS = 4  # each on its own channel, so SO_REUSEPORT spreads them over the fronts
GRACE_S = 600.0  # far longer than EXIT_TIMEOUT_S: a subscription that held the drain would fail the test


class Subscription:
    """One SubscribeKvEvents call on its own channel, replayed into a set."""

    def __init__(self, target: str):
        self.channel = grpc.insecure_channel(target)
        self.call = engine_pb2_grpc.EngineServiceStub(self.channel).SubscribeKvEvents(
            engine_pb2.SubscribeKvEventsRequest(), timeout=CALL_TIMEOUT_S)
        self.first = next(self.call)
        self.hashes = set(self.first.stored_block_hashes)

    def until_cached(self, wanted: list[int]) -> engine_pb2.SubscribeKvEventsResponse:
        """Read changes until every wanted hash is cached; return the message that completed them."""
        for message in self.call:
            assert not message.snapshot
            self.hashes -= set(message.removed_block_hashes)
            self.hashes |= set(message.stored_block_hashes)
            if set(wanted) <= self.hashes:
                return message
        raise AssertionError("the subscription ended before the prompt's blocks were reported")

    def end_code(self) -> grpc.StatusCode:
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_subscribers_on_every_front_report_a_generated_prompts_block_hashes(tiny_checkpoint):
    engine = start_tiny_engine(tiny_checkpoint, api_workers=2, grace_s=GRACE_S)
    subscriptions: list[Subscription] = []
    try:
        with grpc.insecure_channel(engine.target) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            block_size = stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=CALL_TIMEOUT_S).block_size
            subscriptions = [Subscription(engine.target) for _ in range(NUM_SUBSCRIBERS)]
            for subscription in subscriptions:
                assert subscription.first.snapshot and subscription.first.block_size == block_size
                assert subscription.first.load.num_total_blocks == 1024
            prompt = [(7 * i + 3) % 500 + 3 for i in range(3 * block_size + 5)]
            wanted = prompt_block_hashes(prompt, block_size)
            assert len(wanted) == 3 and not any(set(wanted) & s.hashes for s in subscriptions)
            request = engine_pb2.GenerateRequest(request_id="kv", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=2, ignore_eos=True))
            assert [r.finish_reason for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)][-1] == \
                common_pb2.FINISH_REASON_LENGTH
            with ThreadPoolExecutor(NUM_SUBSCRIBERS) as pool:
                lasts = list(pool.map(lambda s: s.until_cached(wanted), subscriptions))
            assert all(last.block_size == block_size and last.load.num_total_blocks == 1024 for last in lasts)
        engine.proc.send_signal(signal.SIGTERM)
        with ThreadPoolExecutor(NUM_SUBSCRIBERS) as pool:
            assert list(pool.map(Subscription.end_code, subscriptions)) == [grpc.StatusCode.UNAVAILABLE] * NUM_SUBSCRIBERS
        assert engine.proc.wait(EXIT_TIMEOUT_S) == 0
    finally:
        for subscription in subscriptions:
            subscription.channel.close()
        engine.kill()
