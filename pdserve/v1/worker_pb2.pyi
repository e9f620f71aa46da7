from pdserve.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "generated_token_ids", "kv_consumer", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CONSUMER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingOptions
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_consumer: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingOptions, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., kv_consumer: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("worker_id", "first_token_id", "block_ids", "num_cached_tokens", "queue_ms", "prefill_ms", "hold_seconds", "first_token_logprobs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    first_token_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    queue_ms: float
    prefill_ms: float
    hold_seconds: float
    first_token_logprobs: _inference_pb2.TokenLogprobs
    def __init__(self, worker_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., hold_seconds: _Optional[float] = ..., first_token_logprobs: _Optional[_Union[_inference_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("worker_id", "peer_info", "block_ids", "first_token_id", "pull_within_s", "pending")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_INFO_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PULL_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    peer_info: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    pull_within_s: float
    pending: bool
    def __init__(self, worker_id: _Optional[str] = ..., peer_info: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., pull_within_s: _Optional[float] = ..., pending: _Optional[bool] = ...) -> None: ...

class KVReadyRequest(_message.Message):
    __slots__ = ("request_id", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_source: KVSource
    def __init__(self, request_id: _Optional[str] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ...) -> None: ...

class KVReadyResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_source", "generated_token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingOptions
    kv_source: KVSource
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingOptions, _Mapping]] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "final", "started", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: DecodeFinal
    started: DecodeStarted
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[_Union[DecodeFinal, _Mapping]] = ..., started: _Optional[_Union[DecodeStarted, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeStarted(_message.Message):
    __slots__ = ("num_cached_tokens", "queue_ms", "prefill_ms", "kv_transfer_ms", "kv_transfer_bytes")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    queue_ms: float
    prefill_ms: float
    kv_transfer_ms: float
    kv_transfer_bytes: int
    def __init__(self, num_cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ...) -> None: ...

class DecodeFinal(_message.Message):
    __slots__ = ("finish_reason",)
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    def __init__(self, finish_reason: _Optional[str] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("reason",)
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[Refusal.Reason]
        REASON_DRAINING: _ClassVar[Refusal.Reason]
        REASON_KV_SOURCE_FAILED: _ClassVar[Refusal.Reason]
    REASON_UNSPECIFIED: Refusal.Reason
    REASON_DRAINING: Refusal.Reason
    REASON_KV_SOURCE_FAILED: Refusal.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: Refusal.Reason
    def __init__(self, reason: _Optional[_Union[Refusal.Reason, str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("in_flight",)
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    def __init__(self, in_flight: _Optional[int] = ...) -> None: ...
