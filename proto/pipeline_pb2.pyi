from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size", "presence_penalty", "frequency_penalty", "penalty_context_size", "has_seed", "seed", "top_logprobs", "logprobs", "logit_bias", "grammar", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    repetition_context_size: int
    presence_penalty: float
    frequency_penalty: float
    penalty_context_size: int
    has_seed: bool
    seed: int
    top_logprobs: int
    logprobs: bool
    logit_bias: _containers.ScalarMap[int, float]
    grammar: str
    prompt_logprobs: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., repetition_context_size: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., penalty_context_size: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[str] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class SeqEntry(_message.Message):
    __slots__ = ("seq_id", "offset", "num_tokens", "sample", "sampling", "reuse", "store_first", "store", "context", "trim", "generated", "snap", "kv_quantize_at", "spill", "mtp", "position_shift", "pool")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIRST_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TRIM_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    SNAP_FIELD_NUMBER: _ClassVar[int]
    KV_QUANTIZE_AT_FIELD_NUMBER: _ClassVar[int]
    SPILL_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    POSITION_SHIFT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    offset: int
    num_tokens: int
    sample: bool
    sampling: SamplingParams
    reuse: _containers.RepeatedScalarFieldContainer[int]
    store_first: int
    store: _containers.RepeatedScalarFieldContainer[int]
    context: _containers.RepeatedScalarFieldContainer[int]
    trim: int
    generated: _containers.RepeatedScalarFieldContainer[int]
    snap: bool
    kv_quantize_at: int
    spill: _containers.RepeatedScalarFieldContainer[int]
    mtp: int
    position_shift: int
    pool: int
    def __init__(self, seq_id: _Optional[int] = ..., offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., sample: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reuse: _Optional[_Iterable[int]] = ..., store_first: _Optional[int] = ..., store: _Optional[_Iterable[int]] = ..., context: _Optional[_Iterable[int]] = ..., trim: _Optional[int] = ..., generated: _Optional[_Iterable[int]] = ..., snap: _Optional[bool] = ..., kv_quantize_at: _Optional[int] = ..., spill: _Optional[_Iterable[int]] = ..., mtp: _Optional[int] = ..., position_shift: _Optional[int] = ..., pool: _Optional[int] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("queued_us", "decode_us", "compute_us", "encode_us")
    QUEUED_US_FIELD_NUMBER: _ClassVar[int]
    DECODE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    ENCODE_US_FIELD_NUMBER: _ClassVar[int]
    queued_us: int
    decode_us: int
    compute_us: int
    encode_us: int
    def __init__(self, queued_us: _Optional[int] = ..., decode_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., encode_us: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("frame_id", "kind", "group", "seqs", "tokens", "hidden", "free", "evict", "discard", "timings", "sent_us", "embeds", "embed_at", "positions")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PREFILL: _ClassVar[Frame.Kind]
        DECODE: _ClassVar[Frame.Kind]
        CONTROL: _ClassVar[Frame.Kind]
        VERIFY: _ClassVar[Frame.Kind]
    PREFILL: Frame.Kind
    DECODE: Frame.Kind
    CONTROL: Frame.Kind
    VERIFY: Frame.Kind
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SENT_US_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    EMBED_AT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    frame_id: int
    kind: Frame.Kind
    group: int
    seqs: _containers.RepeatedCompositeFieldContainer[SeqEntry]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    hidden: Tensor
    free: _containers.RepeatedScalarFieldContainer[int]
    evict: _containers.RepeatedScalarFieldContainer[int]
    discard: _containers.RepeatedScalarFieldContainer[int]
    timings: _containers.RepeatedCompositeFieldContainer[StageTiming]
    sent_us: int
    embeds: Tensor
    embed_at: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, frame_id: _Optional[int] = ..., kind: _Optional[_Union[Frame.Kind, str]] = ..., group: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SeqEntry, _Mapping]]] = ..., tokens: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., free: _Optional[_Iterable[int]] = ..., evict: _Optional[_Iterable[int]] = ..., discard: _Optional[_Iterable[int]] = ..., timings: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ..., sent_us: _Optional[int] = ..., embeds: _Optional[_Union[Tensor, _Mapping]] = ..., embed_at: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenResult(_message.Message):
    __slots__ = ("seq_id", "token", "logprob", "top_ids", "top_logprobs", "done", "embedding", "error", "drafts")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    done: bool
    embedding: _containers.RepeatedScalarFieldContainer[float]
    error: str
    drafts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., done: _Optional[bool] = ..., embedding: _Optional[_Iterable[float]] = ..., error: _Optional[str] = ..., drafts: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptScores(_message.Message):
    __slots__ = ("seq_id", "start", "logprobs", "top_ids", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("frame_id", "tokens", "prompt", "timings")
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    frame_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[TokenResult]
    prompt: _containers.RepeatedCompositeFieldContainer[PromptScores]
    timings: _containers.RepeatedCompositeFieldContainer[StageTiming]
    def __init__(self, frame_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[TokenResult, _Mapping]]] = ..., prompt: _Optional[_Iterable[_Union[PromptScores, _Mapping]]] = ..., timings: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ...) -> None: ...

class WeightUnit(_message.Message):
    __slots__ = ("name", "header", "data_bytes", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    header: bytes
    data_bytes: int
    digest: str
    def __init__(self, name: _Optional[str] = ..., header: _Optional[bytes] = ..., data_bytes: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class WeightsOffer(_message.Message):
    __slots__ = ("model", "fingerprint", "start", "end", "chunk_bytes", "units", "files", "source_fingerprint", "source_digests")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    class SourceDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    start: int
    end: int
    chunk_bytes: int
    units: _containers.RepeatedCompositeFieldContainer[WeightUnit]
    files: _containers.ScalarMap[str, bytes]
    source_fingerprint: str
    source_digests: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., units: _Optional[_Iterable[_Union[WeightUnit, _Mapping]]] = ..., files: _Optional[_Mapping[str, bytes]] = ..., source_fingerprint: _Optional[str] = ..., source_digests: _Optional[_Mapping[str, str]] = ...) -> None: ...

class UnitNeed(_message.Message):
    __slots__ = ("name", "chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    chunks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., chunks: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightsNeed(_message.Message):
    __slots__ = ("local", "units", "have_bytes", "local_digests")
    class LocalDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    HAVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    local: bool
    units: _containers.RepeatedCompositeFieldContainer[UnitNeed]
    have_bytes: int
    local_digests: _containers.ScalarMap[str, str]
    def __init__(self, local: _Optional[bool] = ..., units: _Optional[_Iterable[_Union[UnitNeed, _Mapping]]] = ..., have_bytes: _Optional[int] = ..., local_digests: _Optional[_Mapping[str, str]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("fingerprint", "unit", "index", "data", "sha256")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    unit: str
    index: int
    data: bytes
    sha256: bytes
    def __init__(self, fingerprint: _Optional[str] = ..., unit: _Optional[str] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class ReceiveSummary(_message.Message):
    __slots__ = ("bytes", "rejected")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    rejected: _containers.RepeatedCompositeFieldContainer[UnitNeed]
    def __init__(self, bytes: _Optional[int] = ..., rejected: _Optional[_Iterable[_Union[UnitNeed, _Mapping]]] = ...) -> None: ...

class Quantization(_message.Message):
    __slots__ = ("bits", "group_size", "layer_bits")
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_BITS_FIELD_NUMBER: _ClassVar[int]
    bits: str
    group_size: int
    layer_bits: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bits: _Optional[str] = ..., group_size: _Optional[int] = ..., layer_bits: _Optional[_Iterable[str]] = ...) -> None: ...

class KvQuantization(_message.Message):
    __slots__ = ("bits", "group_size", "start")
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    bits: int
    group_size: int
    start: int
    def __init__(self, bits: _Optional[int] = ..., group_size: _Optional[int] = ..., start: _Optional[int] = ...) -> None: ...

class TokenizerSpec(_message.Message):
    __slots__ = ("json", "eos_token_ids")
    JSON_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    json: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, json: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("model", "start", "end", "next_address", "max_batch", "max_cache_bytes", "fingerprint", "max_chunk_tokens", "block_tokens", "quantization", "tokenizer", "kv_cache", "prefix_disk_bytes", "group", "mtp", "vision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    start: int
    end: int
    next_address: str
    max_batch: int
    max_cache_bytes: int
    fingerprint: str
    max_chunk_tokens: int
    block_tokens: int
    quantization: Quantization
    tokenizer: TokenizerSpec
    kv_cache: KvQuantization
    prefix_disk_bytes: int
    group: TensorGroup
    mtp: bool
    vision: bool
    def __init__(self, model: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., next_address: _Optional[str] = ..., max_batch: _Optional[int] = ..., max_cache_bytes: _Optional[int] = ..., fingerprint: _Optional[str] = ..., max_chunk_tokens: _Optional[int] = ..., block_tokens: _Optional[int] = ..., quantization: _Optional[_Union[Quantization, _Mapping]] = ..., tokenizer: _Optional[_Union[TokenizerSpec, _Mapping]] = ..., kv_cache: _Optional[_Union[KvQuantization, _Mapping]] = ..., prefix_disk_bytes: _Optional[int] = ..., group: _Optional[_Union[TensorGroup, _Mapping]] = ..., mtp: _Optional[bool] = ..., vision: _Optional[bool] = ...) -> None: ...

class TensorGroup(_message.Message):
    __slots__ = ("rank", "size", "peers", "backend", "rdma")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    size: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    rdma: _containers.RepeatedCompositeFieldContainer[RdmaRow]
    def __init__(self, rank: _Optional[int] = ..., size: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., rdma: _Optional[_Iterable[_Union[RdmaRow, _Mapping]]] = ...) -> None: ...

class RdmaRow(_message.Message):
    __slots__ = ("to",)
    TO_FIELD_NUMBER: _ClassVar[int]
    to: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, to: _Optional[_Iterable[str]] = ...) -> None: ...

class GroupItem(_message.Message):
    __slots__ = ("kind", "session", "frame", "seq_ids", "fetch")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FRAME: _ClassVar[GroupItem.Kind]
        FREE: _ClassVar[GroupItem.Kind]
        FREE_SESSION: _ClassVar[GroupItem.Kind]
        FREE_ALL: _ClassVar[GroupItem.Kind]
        FETCH: _ClassVar[GroupItem.Kind]
        STOP: _ClassVar[GroupItem.Kind]
        BEAT: _ClassVar[GroupItem.Kind]
    FRAME: GroupItem.Kind
    FREE: GroupItem.Kind
    FREE_SESSION: GroupItem.Kind
    FREE_ALL: GroupItem.Kind
    FETCH: GroupItem.Kind
    STOP: GroupItem.Kind
    BEAT: GroupItem.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    kind: GroupItem.Kind
    session: int
    frame: Frame
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    fetch: FetchRequest
    def __init__(self, kind: _Optional[_Union[GroupItem.Kind, str]] = ..., session: _Optional[int] = ..., frame: _Optional[_Union[Frame, _Mapping]] = ..., seq_ids: _Optional[_Iterable[int]] = ..., fetch: _Optional[_Union[FetchRequest, _Mapping]] = ...) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("model_path", "model_type", "num_layers", "hidden_size", "vocab_size", "weight_bytes", "model_bytes", "max_context", "fingerprint", "kv_bytes_per_token", "max_cache_bytes", "block_tokens", "blocks", "peak_bytes", "starts", "max_rewind", "state_bytes", "kv_cache", "kv_full_bytes_per_token", "disk_blocks", "disk_starts", "disk_limit_bytes", "disk_block_bytes", "kv_note", "mlx_peak_bytes", "memory_warning", "mtp_layers", "mtp_note", "mtp_bytes", "unit_digests", "weights_digest", "vision", "group_size", "allreduce_seconds", "allreduces_per_token")
    class UnitDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    MAX_REWIND_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_FULL_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_STARTS_FIELD_NUMBER: _ClassVar[int]
    DISK_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_NOTE_FIELD_NUMBER: _ClassVar[int]
    MLX_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_WARNING_FIELD_NUMBER: _ClassVar[int]
    MTP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MTP_NOTE_FIELD_NUMBER: _ClassVar[int]
    MTP_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNIT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    weight_bytes: int
    model_bytes: int
    max_context: int
    fingerprint: str
    kv_bytes_per_token: int
    max_cache_bytes: int
    block_tokens: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    peak_bytes: int
    starts: _containers.RepeatedScalarFieldContainer[int]
    max_rewind: int
    state_bytes: int
    kv_cache: KvQuantization
    kv_full_bytes_per_token: int
    disk_blocks: _containers.RepeatedScalarFieldContainer[int]
    disk_starts: _containers.RepeatedScalarFieldContainer[int]
    disk_limit_bytes: int
    disk_block_bytes: int
    kv_note: str
    mlx_peak_bytes: int
    memory_warning: str
    mtp_layers: int
    mtp_note: str
    mtp_bytes: int
    unit_digests: _containers.ScalarMap[str, str]
    weights_digest: str
    vision: bool
    group_size: int
    allreduce_seconds: float
    allreduces_per_token: int
    def __init__(self, model_path: _Optional[str] = ..., model_type: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., model_bytes: _Optional[int] = ..., max_context: _Optional[int] = ..., fingerprint: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., max_cache_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., peak_bytes: _Optional[int] = ..., starts: _Optional[_Iterable[int]] = ..., max_rewind: _Optional[int] = ..., state_bytes: _Optional[int] = ..., kv_cache: _Optional[_Union[KvQuantization, _Mapping]] = ..., kv_full_bytes_per_token: _Optional[int] = ..., disk_blocks: _Optional[_Iterable[int]] = ..., disk_starts: _Optional[_Iterable[int]] = ..., disk_limit_bytes: _Optional[int] = ..., disk_block_bytes: _Optional[int] = ..., kv_note: _Optional[str] = ..., mlx_peak_bytes: _Optional[int] = ..., memory_warning: _Optional[str] = ..., mtp_layers: _Optional[int] = ..., mtp_note: _Optional[str] = ..., mtp_bytes: _Optional[int] = ..., unit_digests: _Optional[_Mapping[str, str]] = ..., weights_digest: _Optional[str] = ..., vision: _Optional[bool] = ..., group_size: _Optional[int] = ..., allreduce_seconds: _Optional[float] = ..., allreduces_per_token: _Optional[int] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("model", "batch", "quantization")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    batch: int
    quantization: Quantization
    def __init__(self, model: _Optional[str] = ..., batch: _Optional[int] = ..., quantization: _Optional[_Union[Quantization, _Mapping]] = ...) -> None: ...

class ProfileReply(_message.Message):
    __slots__ = ("layer_seconds", "embed_seconds", "head_seconds", "memory_bytes", "node", "cached", "bandwidth_bytes_per_s", "row_cost", "prefill_layer_seconds", "prefill_embed_seconds", "prefill_tokens", "fingerprint")
    LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EMBED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ROW_COST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_EMBED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    layer_seconds: _containers.RepeatedScalarFieldContainer[float]
    embed_seconds: float
    head_seconds: float
    memory_bytes: int
    node: str
    cached: bool
    bandwidth_bytes_per_s: float
    row_cost: float
    prefill_layer_seconds: _containers.RepeatedScalarFieldContainer[float]
    prefill_embed_seconds: float
    prefill_tokens: int
    fingerprint: str
    def __init__(self, layer_seconds: _Optional[_Iterable[float]] = ..., embed_seconds: _Optional[float] = ..., head_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., node: _Optional[str] = ..., cached: _Optional[bool] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., row_cost: _Optional[float] = ..., prefill_layer_seconds: _Optional[_Iterable[float]] = ..., prefill_embed_seconds: _Optional[float] = ..., prefill_tokens: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("seq_id", "keys")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., keys: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("loaded", "dropped")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, loaded: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeReply(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: int
    def __init__(self, freed: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("busy_seconds", "uptime_seconds", "frames", "tokens", "queue_depth", "busy_fraction", "tokens_per_s", "reused_tokens", "prefilled_tokens", "disk_blocks_read", "disk_blocks_written", "disk_blocks_dropped", "mirror_seconds", "mirrored")
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    MIRROR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIRRORED_FIELD_NUMBER: _ClassVar[int]
    busy_seconds: float
    uptime_seconds: float
    frames: int
    tokens: int
    queue_depth: int
    busy_fraction: float
    tokens_per_s: float
    reused_tokens: int
    prefilled_tokens: int
    disk_blocks_read: int
    disk_blocks_written: int
    disk_blocks_dropped: int
    mirror_seconds: float
    mirrored: int
    def __init__(self, busy_seconds: _Optional[float] = ..., uptime_seconds: _Optional[float] = ..., frames: _Optional[int] = ..., tokens: _Optional[int] = ..., queue_depth: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., reused_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., disk_blocks_read: _Optional[int] = ..., disk_blocks_written: _Optional[int] = ..., disk_blocks_dropped: _Optional[int] = ..., mirror_seconds: _Optional[float] = ..., mirrored: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("state", "detail", "model", "start", "end", "num_layers", "weight_bytes", "active_bytes", "cache_bytes", "rss_bytes", "live_seqs", "stats", "next_address", "prefix_bytes", "prefix_blocks", "next_link", "in_link", "prefix_disk_bytes", "prefix_disk_blocks", "prefix_disk_limit", "group_rank", "group_size", "allreduce_seconds", "allreduces_per_token")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_LINK_FIELD_NUMBER: _ClassVar[int]
    IN_LINK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DISK_LIMIT_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    state: str
    detail: str
    model: str
    start: int
    end: int
    num_layers: int
    weight_bytes: int
    active_bytes: int
    cache_bytes: int
    rss_bytes: int
    live_seqs: _containers.RepeatedScalarFieldContainer[int]
    stats: StageStats
    next_address: str
    prefix_bytes: int
    prefix_blocks: int
    next_link: LinkFigures
    in_link: LinkFigures
    prefix_disk_bytes: int
    prefix_disk_blocks: int
    prefix_disk_limit: int
    group_rank: int
    group_size: int
    allreduce_seconds: float
    allreduces_per_token: int
    def __init__(self, state: _Optional[str] = ..., detail: _Optional[str] = ..., model: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., num_layers: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., active_bytes: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., live_seqs: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[StageStats, _Mapping]] = ..., next_address: _Optional[str] = ..., prefix_bytes: _Optional[int] = ..., prefix_blocks: _Optional[int] = ..., next_link: _Optional[_Union[LinkFigures, _Mapping]] = ..., in_link: _Optional[_Union[LinkFigures, _Mapping]] = ..., prefix_disk_bytes: _Optional[int] = ..., prefix_disk_blocks: _Optional[int] = ..., prefix_disk_limit: _Optional[int] = ..., group_rank: _Optional[int] = ..., group_size: _Optional[int] = ..., allreduce_seconds: _Optional[float] = ..., allreduces_per_token: _Optional[int] = ...) -> None: ...

class LinkFigures(_message.Message):
    __slots__ = ("latency_s", "bytes_per_s", "jitter_s", "samples", "measured_at", "to")
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    JITTER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    latency_s: float
    bytes_per_s: float
    jitter_s: float
    samples: int
    measured_at: float
    to: str
    def __init__(self, latency_s: _Optional[float] = ..., bytes_per_s: _Optional[float] = ..., jitter_s: _Optional[float] = ..., samples: _Optional[int] = ..., measured_at: _Optional[float] = ..., to: _Optional[str] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class EchoReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class LinkProbe(_message.Message):
    __slots__ = ("small", "large", "address")
    SMALL_FIELD_NUMBER: _ClassVar[int]
    LARGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    small: int
    large: int
    address: str
    def __init__(self, small: _Optional[int] = ..., large: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("proof", "name", "chip", "memory_bytes", "mlxpipe_version", "mlx_version", "mlx_lm_version", "time_s", "cluster", "group_port", "rdma", "rdma_ports")
    PROOF_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLXPIPE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MLX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MLX_LM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    GROUP_PORT_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    RDMA_PORTS_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    name: str
    chip: str
    memory_bytes: int
    mlxpipe_version: str
    mlx_version: str
    mlx_lm_version: str
    time_s: float
    cluster: str
    group_port: int
    rdma: _containers.RepeatedScalarFieldContainer[str]
    rdma_ports: _containers.RepeatedCompositeFieldContainer[RdmaPort]
    def __init__(self, proof: _Optional[bytes] = ..., name: _Optional[str] = ..., chip: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., mlxpipe_version: _Optional[str] = ..., mlx_version: _Optional[str] = ..., mlx_lm_version: _Optional[str] = ..., time_s: _Optional[float] = ..., cluster: _Optional[str] = ..., group_port: _Optional[int] = ..., rdma: _Optional[_Iterable[str]] = ..., rdma_ports: _Optional[_Iterable[_Union[RdmaPort, _Mapping]]] = ...) -> None: ...

class RdmaPort(_message.Message):
    __slots__ = ("device", "port", "peer")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    device: str
    port: str
    peer: str
    def __init__(self, device: _Optional[str] = ..., port: _Optional[str] = ..., peer: _Optional[str] = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForwardSummary(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: int
    def __init__(self, frames: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("address", "name", "memory_bytes", "bandwidth_bytes_per_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., bandwidth_bytes_per_s: _Optional[float] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("model", "in_plan", "detail")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IN_PLAN_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    model: str
    in_plan: bool
    detail: str
    def __init__(self, model: _Optional[str] = ..., in_plan: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...
