from google.protobuf import any_pb2 as _any_pb2
from llmserve.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "usage", "matched_stop_token_id", "timing", "logprobs", "num_preemptions", "index", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    matched_stop_token_id: int
    timing: _common_pb2.RequestTiming
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    num_preemptions: int
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., matched_stop_token_id: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.RequestTiming, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., num_preemptions: _Optional[int] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids", "completions")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    completions: _containers.RepeatedCompositeFieldContainer[CompletionRef]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., completions: _Optional[_Iterable[_Union[CompletionRef, _Mapping]]] = ...) -> None: ...

class CompletionRef(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids", "aborted_completions")
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    aborted_completions: _containers.RepeatedCompositeFieldContainer[CompletionRef]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ..., aborted_completions: _Optional[_Iterable[_Union[CompletionRef, _Mapping]]] = ...) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEngineInfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_model_len", "eos_token_ids", "tokenizer_fingerprint", "block_size", "num_total_blocks", "device", "dtype", "architecture", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "tensor_parallel_size")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_fingerprint: str
    block_size: int
    num_total_blocks: int
    device: str
    dtype: str
    architecture: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    tensor_parallel_size: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., architecture: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_used_blocks", "num_total_blocks", "num_preemptions", "num_cached_prompt_tokens", "num_prompt_tokens", "num_generated_tokens", "num_finished_requests", "draining")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_cached_prompt_tokens: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_finished_requests: int
    draining: bool
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_cached_prompt_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_finished_requests: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeKvEventsResponse(_message.Message):
    __slots__ = ("snapshot", "stored_block_hashes", "removed_block_hashes", "block_size", "load")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    stored_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    removed_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    load: LoadReport
    def __init__(self, snapshot: _Optional[bool] = ..., stored_block_hashes: _Optional[_Iterable[int]] = ..., removed_block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests", "cancel_request_ids")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    cancel_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., cancel_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("responses", "errors")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    def __init__(self, responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "status")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: RequestStatus
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[RequestStatus, _Mapping]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("code", "message", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    details: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., details: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...
