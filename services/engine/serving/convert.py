"""Protobuf <-> core types for the engine service (the only engine module besides server.py that sees stubs)."""

from llmserve.common.v1 import common_pb2
from llmserve.engine.v1 import engine_pb2

from services.common.convert import RequestClock, constraint_fields
from services.common.grpc_server import status_for
from services.common.validation import PROMPT_TOKEN_IDS, check_room_for_completion, check_wire_sampling
from services.engine.core.interfaces import EngineStats, PromptLogprobs, RequestOutput, TokenLogprobs
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.sequence import FinishReason
from services.engine.serving.batch_session import BatchOutputs
from services.engine.serving.kv_subscribers import KvEventBatch

_FINISH_REASONS = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.ABORTED: common_pb2.FINISH_REASON_ABORTED,
}


def sampling_from_proto(proto: common_pb2.SamplingParams, num_prompt_tokens: int,
                        max_model_len: int) -> SamplingParams:
    """Resolved engine sampling values; unset fields take neutral values, unset max_tokens fills the context.

    Raises InvalidRequestError naming the proto field ("sampling.top_p", ...): the checks are
    services.common.validation's, shared with the tokenizer service and the offline API.
    """
    check_wire_sampling(top_k=proto.top_k if proto.HasField("top_k") else None)
    if proto.HasField("max_tokens"):
        max_tokens = proto.max_tokens
    else:
        check_room_for_completion(PROMPT_TOKEN_IDS, num_prompt_tokens, max_model_len)
        max_tokens = max_model_len - num_prompt_tokens
    return SamplingParams(
        temperature=proto.temperature if proto.HasField("temperature") else 1.0,
        top_k=proto.top_k if proto.HasField("top_k") else 0,
        top_p=proto.top_p if proto.HasField("top_p") else 1.0,
        min_p=proto.min_p if proto.HasField("min_p") else 0.0,
        seed=proto.seed if proto.HasField("seed") else None,
        max_tokens=max_tokens,
        min_tokens=proto.min_tokens if proto.HasField("min_tokens") else 0,
        ignore_eos=proto.ignore_eos,
        stop_token_ids=list(proto.stop_token_ids),
        num_logprobs=proto.num_logprobs if proto.HasField("num_logprobs") else None,
        repetition_penalty=proto.repetition_penalty if proto.HasField("repetition_penalty") else 1.0,
        presence_penalty=proto.presence_penalty,
        frequency_penalty=proto.frequency_penalty,
        n=proto.n if proto.HasField("n") else 1,
        best_of=proto.best_of if proto.HasField("best_of") else None,
        num_prompt_logprobs=proto.num_prompt_logprobs if proto.HasField("num_prompt_logprobs") else None,
        **constraint_fields(proto),
    )


def response_from_output(output: RequestOutput, timing: RequestClock,
                         response: engine_pb2.GenerateResponse | None = None) -> engine_pb2.GenerateResponse:
    """The Generate message of one output; filled into `response` (a new, empty one) when given."""
    if response is None:
        response = engine_pb2.GenerateResponse()
    response.request_id = output.request_id
    if output.index:
        response.index = output.index
    response.token_ids.extend(output.new_token_ids)
    usage = response.usage
    usage.prompt_tokens = output.num_prompt_tokens
    usage.completion_tokens = output.num_completion_tokens
    usage.cached_tokens = output.num_cached_tokens
    if output.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[output.finish_reason]
        response.timing.CopyFrom(timing.to_proto())
        if output.matched_stop_token_id is not None:
            response.matched_stop_token_id = output.matched_stop_token_id
    if output.logprobs:
        response.logprobs.extend(position_logprobs(token_id, position)
                                 for token_id, position in zip(output.new_token_ids, output.logprobs))
    if output.prompt_logprobs is not None:
        response.prompt_logprobs.extend(prompt_position_logprobs(output.prompt_logprobs))
    return response


def batch_responses(batch: BatchOutputs) -> list[engine_pb2.GenerateBatchResponse]:
    """The GenerateBatch messages of one collect(): each output as its Generate message, each error as the status
    Generate ends with. An output carrying prompt logprobs (up to ~1 MB for a long prompt) gets a message of its
    own, so that a step finishing many such prompts never makes one message near the receiver's size limit."""
    response = engine_pb2.GenerateBatchResponse()
    add = response.responses.add
    alone = []
    for request, output in batch.outputs:
        if output.prompt_logprobs is not None:
            alone.append(engine_pb2.GenerateBatchResponse(responses=[response_from_output(output, request.clock)]))
        else:
            response_from_output(output, request.clock, add())  # built in place: no copy into the batch
    for request_id, exc in batch.errors:
        status = status_for(exc)
        response.errors.add(request_id=request_id).status.ParseFromString(status.SerializeToString())
    return [response, *alone] if response.responses or response.errors else alone


def position_logprobs(token_id: int, position: TokenLogprobs) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=token_id, logprob=position.logprob),
        top=[common_pb2.TokenLogprob(token_id=i, logprob=v)
             for i, v in zip(position.top_token_ids, position.top_logprobs)])


def completion_refs_from_proto(refs) -> list[tuple[str, int]]:
    """AbortRequest.completions as (request id, index) pairs."""
    return [(ref.request_id, ref.index) for ref in refs]


def completion_refs_to_proto(refs: list[tuple[str, int]]) -> list[engine_pb2.CompletionRef]:
    return [engine_pb2.CompletionRef(request_id=request_id, index=index) for request_id, index in refs]


def prompt_position_logprobs(prompt: PromptLogprobs) -> list[common_pb2.PositionLogprobs]:
    """One entry per prompt token: the first empty (nothing predicts it), then each token's logprob and top."""
    k = prompt.num_top
    entries = [common_pb2.PositionLogprobs()]
    for j, (token_id, logprob) in enumerate(zip(prompt.token_ids, prompt.logprobs)):
        entries.append(common_pb2.PositionLogprobs(
            sampled=common_pb2.TokenLogprob(token_id=token_id, logprob=logprob),
            top=[common_pb2.TokenLogprob(token_id=i, logprob=v)
                 for i, v in zip(prompt.top_token_ids[j * k:(j + 1) * k], prompt.top_logprobs[j * k:(j + 1) * k])]))
    return entries


def kv_events_response(batch: KvEventBatch, block_size: int,
                       load: engine_pb2.LoadReport) -> engine_pb2.SubscribeKvEventsResponse:
    return engine_pb2.SubscribeKvEventsResponse(
        snapshot=batch.snapshot, stored_block_hashes=batch.stored_block_hashes,
        removed_block_hashes=batch.removed_block_hashes, block_size=block_size, load=load)


def load_report(stats: EngineStats, num_finished_requests: int, draining: bool) -> engine_pb2.LoadReport:
    return engine_pb2.LoadReport(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_used_blocks=stats.num_used_blocks,
        num_total_blocks=stats.num_total_blocks,
        num_preemptions=stats.num_preemptions,
        num_cached_prompt_tokens=stats.num_cached_prompt_tokens,
        num_prompt_tokens=stats.num_cached_prompt_tokens + stats.num_computed_prompt_tokens,
        num_generated_tokens=stats.num_generated_tokens,
        num_finished_requests=num_finished_requests,
        draining=draining,
    )
