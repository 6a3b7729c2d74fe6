from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KvDtype]

class AskPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ASK_PATH_UNSPECIFIED: _ClassVar[AskPath]
    ASK_PATH_RECALL: _ClassVar[AskPath]
    ASK_PATH_GENERATE: _ClassVar[AskPath]
    ASK_PATH_LIBRARY: _ClassVar[AskPath]
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FLOAT32: KvDtype
KV_DTYPE_FLOAT16: KvDtype
KV_DTYPE_BFLOAT16: KvDtype
ASK_PATH_UNSPECIFIED: AskPath
ASK_PATH_RECALL: AskPath
ASK_PATH_GENERATE: AskPath
ASK_PATH_LIBRARY: AskPath

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "kv_heads", "head_dim", "kv_dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: KvDtype
    def __init__(self, num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_dtype: _Optional[_Union[KvDtype, str]] = ...) -> None: ...

class ComputeProfile(_message.Message):
    __slots__ = ("torch_version", "device_kind", "device_name", "compute_dtype", "attention", "page_tokens", "products")
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRODUCTS_FIELD_NUMBER: _ClassVar[int]
    torch_version: str
    device_kind: str
    device_name: str
    compute_dtype: str
    attention: str
    page_tokens: int
    products: str
    def __init__(self, torch_version: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_name: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., attention: _Optional[str] = ..., page_tokens: _Optional[int] = ..., products: _Optional[str] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256", "generated_token_ids", "reused_tokens", "computed_tokens", "model_fingerprint", "profile", "grafted_artifact_id", "grafted", "sampling")
    INPUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGITS_SHA256_FIELD_NUMBER: _ClassVar[int]
    GENERATED_LOGITS_SHA256_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    GRAFTED_ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    GRAFTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    input_sha256: bytes
    prompt_logits_sha256: bytes
    generated_logits_sha256: bytes
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reused_tokens: int
    computed_tokens: int
    model_fingerprint: bytes
    profile: ComputeProfile
    grafted_artifact_id: str
    grafted: _containers.RepeatedCompositeFieldContainer[GraftedArtifact]
    sampling: Sampling
    def __init__(self, input_sha256: _Optional[bytes] = ..., prompt_logits_sha256: _Optional[bytes] = ..., generated_logits_sha256: _Optional[bytes] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., reused_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ..., profile: _Optional[_Union[ComputeProfile, _Mapping]] = ..., grafted_artifact_id: _Optional[str] = ..., grafted: _Optional[_Iterable[_Union[GraftedArtifact, _Mapping]]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("greedy", "temperature", "top_p", "top_k", "seed", "stop")
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, greedy: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class GraftedArtifact(_message.Message):
    __slots__ = ("artifact_id", "tokens", "trust", "vouched_by", "owner")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    VOUCHED_BY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    tokens: int
    trust: Provenance.Trust
    vouched_by: bytes
    owner: str
    def __init__(self, artifact_id: _Optional[str] = ..., tokens: _Optional[int] = ..., trust: _Optional[_Union[Provenance.Trust, str]] = ..., vouched_by: _Optional[bytes] = ..., owner: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("format_version", "model_fingerprint", "layout", "profile", "token_ids", "segment_ends", "page_sha256", "receipt", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ENDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    model_fingerprint: bytes
    layout: KvLayout
    profile: ComputeProfile
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    segment_ends: _containers.RepeatedScalarFieldContainer[int]
    page_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    receipt: Receipt
    labels: _containers.ScalarMap[str, str]
    def __init__(self, format_version: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., profile: _Optional[_Union[ComputeProfile, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., segment_ends: _Optional[_Iterable[int]] = ..., page_sha256: _Optional[_Iterable[bytes]] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("sha256", "offset", "page_bytes", "xxh3", "data")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sha256: bytes
    offset: int
    page_bytes: int
    xxh3: bytes
    data: bytes
    def __init__(self, sha256: _Optional[bytes] = ..., offset: _Optional[int] = ..., page_bytes: _Optional[int] = ..., xxh3: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PageBlock(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[PageChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[PageChunk, _Mapping]]] = ...) -> None: ...

class PutArtifactRequest(_message.Message):
    __slots__ = ("pages", "manifest", "expected_artifact_id", "signatures", "relayed_from")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FROM_FIELD_NUMBER: _ClassVar[int]
    pages: PageBlock
    manifest: Manifest
    expected_artifact_id: str
    signatures: _containers.RepeatedCompositeFieldContainer[ArtifactSignature]
    relayed_from: str
    def __init__(self, pages: _Optional[_Union[PageBlock, _Mapping]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., expected_artifact_id: _Optional[str] = ..., signatures: _Optional[_Iterable[_Union[ArtifactSignature, _Mapping]]] = ..., relayed_from: _Optional[str] = ...) -> None: ...

class ArtifactSignature(_message.Message):
    __slots__ = ("public_key", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Provenance(_message.Message):
    __slots__ = ("trust", "origin", "vouched_by", "signatures", "unix_ms", "replicated_from")
    class Trust(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TRUST_UNSPECIFIED: _ClassVar[Provenance.Trust]
        TRUST_COMPUTED: _ClassVar[Provenance.Trust]
        TRUST_VERIFIED: _ClassVar[Provenance.Trust]
        TRUST_SIGNED: _ClassVar[Provenance.Trust]
        TRUST_UNTRUSTED: _ClassVar[Provenance.Trust]
    TRUST_UNSPECIFIED: Provenance.Trust
    TRUST_COMPUTED: Provenance.Trust
    TRUST_VERIFIED: Provenance.Trust
    TRUST_SIGNED: Provenance.Trust
    TRUST_UNTRUSTED: Provenance.Trust
    TRUST_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    VOUCHED_BY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FROM_FIELD_NUMBER: _ClassVar[int]
    trust: Provenance.Trust
    origin: str
    vouched_by: bytes
    signatures: _containers.RepeatedCompositeFieldContainer[ArtifactSignature]
    unix_ms: int
    replicated_from: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trust: _Optional[_Union[Provenance.Trust, str]] = ..., origin: _Optional[str] = ..., vouched_by: _Optional[bytes] = ..., signatures: _Optional[_Iterable[_Union[ArtifactSignature, _Mapping]]] = ..., unix_ms: _Optional[int] = ..., replicated_from: _Optional[_Iterable[str]] = ...) -> None: ...

class PutArtifactResponse(_message.Message):
    __slots__ = ("artifact_id", "already_present", "pages_written", "bytes_written")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    already_present: bool
    pages_written: int
    bytes_written: int
    def __init__(self, artifact_id: _Optional[str] = ..., already_present: _Optional[bool] = ..., pages_written: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...

class GetArtifactRequest(_message.Message):
    __slots__ = ("artifact_id", "manifest_only", "only_pages")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    ONLY_PAGES_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    manifest_only: bool
    only_pages: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, artifact_id: _Optional[str] = ..., manifest_only: _Optional[bool] = ..., only_pages: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetArtifactResponse(_message.Message):
    __slots__ = ("manifest", "pages", "signatures")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    pages: PageBlock
    signatures: _containers.RepeatedCompositeFieldContainer[ArtifactSignature]
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., pages: _Optional[_Union[PageBlock, _Mapping]] = ..., signatures: _Optional[_Iterable[_Union[ArtifactSignature, _Mapping]]] = ...) -> None: ...

class MissingPagesRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, sha256: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MissingPagesResponse(_message.Message):
    __slots__ = ("missing",)
    MISSING_FIELD_NUMBER: _ClassVar[int]
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("token_ids", "prompt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: Prompt
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched_tokens", "matched_pages", "model_fingerprint", "untrusted_tokens", "untrusted_artifact_id")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    UNTRUSTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNTRUSTED_ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    matched_pages: int
    model_fingerprint: bytes
    untrusted_tokens: int
    untrusted_artifact_id: str
    def __init__(self, matched_tokens: _Optional[int] = ..., matched_pages: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ..., untrusted_tokens: _Optional[int] = ..., untrusted_artifact_id: _Optional[str] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "tokens", "conversation", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenIds
    conversation: Conversation
    chat: bool
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., conversation: _Optional[_Union[Conversation, _Mapping]] = ..., chat: _Optional[bool] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DepositRequest(_message.Message):
    __slots__ = ("prompt", "labels", "verified_by")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BY_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    labels: _containers.ScalarMap[str, str]
    verified_by: str
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., verified_by: _Optional[str] = ...) -> None: ...

class DepositResponse(_message.Message):
    __slots__ = ("artifact_id", "receipt")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    receipt: Receipt
    def __init__(self, artifact_id: _Optional[str] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ...) -> None: ...

class GenerateOptions(_message.Message):
    __slots__ = ("max_new_tokens", "greedy", "no_cache", "deposit", "temperature", "seed", "labels", "return_logits", "allow_untrusted", "progress", "top_p", "top_k", "stop", "logprobs", "top_logprobs", "keep")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    DEPOSIT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_UNTRUSTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    greedy: bool
    no_cache: bool
    deposit: bool
    temperature: float
    seed: int
    labels: _containers.ScalarMap[str, str]
    return_logits: bool
    allow_untrusted: bool
    progress: bool
    top_p: float
    top_k: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    keep: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., greedy: _Optional[bool] = ..., no_cache: _Optional[bool] = ..., deposit: _Optional[bool] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., return_logits: _Optional[bool] = ..., allow_untrusted: _Optional[bool] = ..., progress: _Optional[bool] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., keep: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "options")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    options: GenerateOptions
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., options: _Optional[_Union[GenerateOptions, _Mapping]] = ...) -> None: ...

class GraftRequest(_message.Message):
    __slots__ = ("artifact_id", "continuation", "options")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    continuation: Prompt
    options: GenerateOptions
    def __init__(self, artifact_id: _Optional[str] = ..., continuation: _Optional[_Union[Prompt, _Mapping]] = ..., options: _Optional[_Union[GenerateOptions, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token", "result", "progress")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    token: GeneratedToken
    result: GenerateResult
    progress: Progress
    def __init__(self, token: _Optional[_Union[GeneratedToken, _Mapping]] = ..., result: _Optional[_Union[GenerateResult, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("prompt_tokens_done", "prompt_tokens", "reused_tokens")
    PROMPT_TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens_done: int
    prompt_tokens: int
    reused_tokens: int
    def __init__(self, prompt_tokens_done: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class GeneratedToken(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("receipt", "text", "deposited_artifact_id", "prompt_logits", "generated_logits", "finish_reason")
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DEPOSITED_ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_LOGITS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    receipt: Receipt
    text: str
    deposited_artifact_id: str
    prompt_logits: bytes
    generated_logits: _containers.RepeatedScalarFieldContainer[bytes]
    finish_reason: str
    def __init__(self, receipt: _Optional[_Union[Receipt, _Mapping]] = ..., text: _Optional[str] = ..., deposited_artifact_id: _Optional[str] = ..., prompt_logits: _Optional[bytes] = ..., generated_logits: _Optional[_Iterable[bytes]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("artifact_id",)
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    def __init__(self, artifact_id: _Optional[str] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("ok", "stored", "recomputed", "mismatches")
    OK_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    stored: Receipt
    recomputed: Receipt
    mismatches: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., stored: _Optional[_Union[Receipt, _Mapping]] = ..., recomputed: _Optional[_Union[Receipt, _Mapping]] = ..., mismatches: _Optional[_Iterable[str]] = ...) -> None: ...

class ArtifactInfo(_message.Message):
    __slots__ = ("artifact_id", "num_tokens", "num_segments", "num_pages", "page_bytes", "layout", "model_fingerprint", "labels", "created_unix_ms", "pinned", "sequence", "provenance", "pin_expires_unix_ms", "last_used_unix_ms", "reused_tokens", "quarantined")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    PIN_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    num_tokens: int
    num_segments: int
    num_pages: int
    page_bytes: int
    layout: KvLayout
    model_fingerprint: bytes
    labels: _containers.ScalarMap[str, str]
    created_unix_ms: int
    pinned: bool
    sequence: int
    provenance: Provenance
    pin_expires_unix_ms: int
    last_used_unix_ms: int
    reused_tokens: int
    quarantined: bool
    def __init__(self, artifact_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_segments: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., model_fingerprint: _Optional[bytes] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_unix_ms: _Optional[int] = ..., pinned: _Optional[bool] = ..., sequence: _Optional[int] = ..., provenance: _Optional[_Union[Provenance, _Mapping]] = ..., pin_expires_unix_ms: _Optional[int] = ..., last_used_unix_ms: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., quarantined: _Optional[bool] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "label_selector")
    class LabelSelectorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LABEL_SELECTOR_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    label_selector: _containers.ScalarMap[str, str]
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., label_selector: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("artifacts", "next_page_token")
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactInfo]
    next_page_token: str
    def __init__(self, artifacts: _Optional[_Iterable[_Union[ArtifactInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("artifact_id", "include_manifest")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    include_manifest: bool
    def __init__(self, artifact_id: _Optional[str] = ..., include_manifest: _Optional[bool] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("info", "manifest")
    INFO_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    info: ArtifactInfo
    manifest: Manifest
    def __init__(self, info: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("artifact_id",)
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    def __init__(self, artifact_id: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("pages_freed", "bytes_freed")
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    pages_freed: int
    bytes_freed: int
    def __init__(self, pages_freed: _Optional[int] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("artifact_id", "withdraw")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    withdraw: bool
    def __init__(self, artifact_id: _Optional[str] = ..., withdraw: _Optional[bool] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ArtifactInfo
    def __init__(self, info: _Optional[_Union[ArtifactInfo, _Mapping]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("artifact_id", "pinned", "ttl_s")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    pinned: bool
    ttl_s: int
    def __init__(self, artifact_id: _Optional[str] = ..., pinned: _Optional[bool] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ArtifactInfo
    def __init__(self, info: _Optional[_Union[ArtifactInfo, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "store_format_version", "page_tokens", "model_fingerprint", "profile", "model_name", "tiers", "model_state", "instance_id", "signing_key", "cache", "scrub", "tenant", "tenants", "model_family", "schedule", "chat_template")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_STATE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNING_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SCRUB_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    version: str
    store_format_version: int
    page_tokens: int
    model_fingerprint: bytes
    profile: ComputeProfile
    model_name: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierInfo]
    model_state: str
    instance_id: str
    signing_key: bytes
    cache: CacheInfo
    scrub: ScrubProgress
    tenant: str
    tenants: _containers.RepeatedScalarFieldContainer[str]
    model_family: str
    schedule: str
    chat_template: str
    def __init__(self, version: _Optional[str] = ..., store_format_version: _Optional[int] = ..., page_tokens: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ..., profile: _Optional[_Union[ComputeProfile, _Mapping]] = ..., model_name: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierInfo, _Mapping]]] = ..., model_state: _Optional[str] = ..., instance_id: _Optional[str] = ..., signing_key: _Optional[bytes] = ..., cache: _Optional[_Union[CacheInfo, _Mapping]] = ..., scrub: _Optional[_Union[ScrubProgress, _Mapping]] = ..., tenant: _Optional[str] = ..., tenants: _Optional[_Iterable[str]] = ..., model_family: _Optional[str] = ..., schedule: _Optional[str] = ..., chat_template: _Optional[str] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("budget_bytes", "budget_artifacts", "policy", "mode", "evicted_artifacts", "evicted_bytes", "expired_artifacts", "auto_deposits", "auto_deposits_skipped", "quarantined_artifacts")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    AUTO_DEPOSITS_FIELD_NUMBER: _ClassVar[int]
    AUTO_DEPOSITS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    budget_artifacts: int
    policy: str
    mode: str
    evicted_artifacts: int
    evicted_bytes: int
    expired_artifacts: int
    auto_deposits: int
    auto_deposits_skipped: int
    quarantined_artifacts: int
    def __init__(self, budget_bytes: _Optional[int] = ..., budget_artifacts: _Optional[int] = ..., policy: _Optional[str] = ..., mode: _Optional[str] = ..., evicted_artifacts: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., expired_artifacts: _Optional[int] = ..., auto_deposits: _Optional[int] = ..., auto_deposits_skipped: _Optional[int] = ..., quarantined_artifacts: _Optional[int] = ...) -> None: ...

class ScrubRequest(_message.Message):
    __slots__ = ("bytes_per_s",)
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    bytes_per_s: int
    def __init__(self, bytes_per_s: _Optional[int] = ...) -> None: ...

class ScrubProgress(_message.Message):
    __slots__ = ("pages_done", "pages_total", "bytes_done", "bytes_total", "corrupt_pages", "quarantined", "done", "started_unix_ms", "finished_unix_ms", "running", "corrupt_count", "quarantined_count")
    PAGES_DONE_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_COUNT_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_COUNT_FIELD_NUMBER: _ClassVar[int]
    pages_done: int
    pages_total: int
    bytes_done: int
    bytes_total: int
    corrupt_pages: _containers.RepeatedScalarFieldContainer[str]
    quarantined: _containers.RepeatedScalarFieldContainer[str]
    done: bool
    started_unix_ms: int
    finished_unix_ms: int
    running: bool
    corrupt_count: int
    quarantined_count: int
    def __init__(self, pages_done: _Optional[int] = ..., pages_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., corrupt_pages: _Optional[_Iterable[str]] = ..., quarantined: _Optional[_Iterable[str]] = ..., done: _Optional[bool] = ..., started_unix_ms: _Optional[int] = ..., finished_unix_ms: _Optional[int] = ..., running: _Optional[bool] = ..., corrupt_count: _Optional[int] = ..., quarantined_count: _Optional[int] = ...) -> None: ...

class TierInfo(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "hits", "misses", "evictions", "bytes_streamed", "peak_bytes", "backlog_artifacts", "holding_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_STREAMED_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    HOLDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    hits: int
    misses: int
    evictions: int
    bytes_streamed: int
    peak_bytes: int
    backlog_artifacts: int
    holding_bytes: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_streamed: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., backlog_artifacts: _Optional[int] = ..., holding_bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("artifacts", "pages", "page_bytes", "staged_pages", "map_size_bytes", "map_used_bytes", "disk_free_bytes", "last_sequence", "tiers", "rpc_calls", "rss_anon_bytes", "device_max_allocated_bytes", "segment_disk_bytes")
    class RpcCallsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAP_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAP_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    RPC_CALLS_FIELD_NUMBER: _ClassVar[int]
    RSS_ANON_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MAX_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    artifacts: int
    pages: int
    page_bytes: int
    staged_pages: int
    map_size_bytes: int
    map_used_bytes: int
    disk_free_bytes: int
    last_sequence: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierInfo]
    rpc_calls: _containers.ScalarMap[str, int]
    rss_anon_bytes: int
    device_max_allocated_bytes: int
    segment_disk_bytes: int
    def __init__(self, artifacts: _Optional[int] = ..., pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., staged_pages: _Optional[int] = ..., map_size_bytes: _Optional[int] = ..., map_used_bytes: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ..., last_sequence: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierInfo, _Mapping]]] = ..., rpc_calls: _Optional[_Mapping[str, int]] = ..., rss_anon_bytes: _Optional[int] = ..., device_max_allocated_bytes: _Optional[int] = ..., segment_disk_bytes: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("from_sequence", "follow")
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    follow: bool
    def __init__(self, from_sequence: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class ChangeRecord(_message.Message):
    __slots__ = ("sequence", "kind", "artifact_id", "unix_ms", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ChangeRecord.Kind]
        KIND_ADDED: _ClassVar[ChangeRecord.Kind]
        KIND_DELETED: _ClassVar[ChangeRecord.Kind]
    KIND_UNSPECIFIED: ChangeRecord.Kind
    KIND_ADDED: ChangeRecord.Kind
    KIND_DELETED: ChangeRecord.Kind
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[ChangeRecord.Reason]
        REASON_EVICTED: _ClassVar[ChangeRecord.Reason]
        REASON_EXPIRED: _ClassVar[ChangeRecord.Reason]
    REASON_UNSPECIFIED: ChangeRecord.Reason
    REASON_EVICTED: ChangeRecord.Reason
    REASON_EXPIRED: ChangeRecord.Reason
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: ChangeRecord.Kind
    artifact_id: str
    unix_ms: int
    reason: ChangeRecord.Reason
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[ChangeRecord.Kind, str]] = ..., artifact_id: _Optional[str] = ..., unix_ms: _Optional[int] = ..., reason: _Optional[_Union[ChangeRecord.Reason, str]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("source", "from_sequence")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    source: str
    from_sequence: int
    def __init__(self, source: _Optional[str] = ..., from_sequence: _Optional[int] = ...) -> None: ...

class ReplicateProgress(_message.Message):
    __slots__ = ("bytes_planned", "bytes_done", "done", "summary")
    BYTES_PLANNED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    bytes_planned: int
    bytes_done: int
    done: bool
    summary: ReplicationSummary
    def __init__(self, bytes_planned: _Optional[int] = ..., bytes_done: _Optional[int] = ..., done: _Optional[bool] = ..., summary: _Optional[_Union[ReplicationSummary, _Mapping]] = ...) -> None: ...

class ReplicationSummary(_message.Message):
    __slots__ = ("source", "target", "artifacts_added", "artifacts_present", "artifacts_deleted", "deletes_kept_pinned", "deletes_kept_foreign", "artifacts_vanished", "artifacts_failed", "pages_moved", "bytes_moved", "pages_resent", "bytes_resent", "pages_written", "bytes_written", "retries", "last_sequence", "elapsed_s", "retry_reasons", "failures", "artifacts_repaired", "repaired", "expired_not_restored")
    class FailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_ADDED_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_PRESENT_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    DELETES_KEPT_PINNED_FIELD_NUMBER: _ClassVar[int]
    DELETES_KEPT_FOREIGN_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_VANISHED_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    PAGES_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    PAGES_RESENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESENT_FIELD_NUMBER: _ClassVar[int]
    PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_REASONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_REPAIRED_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_NOT_RESTORED_FIELD_NUMBER: _ClassVar[int]
    source: str
    target: str
    artifacts_added: int
    artifacts_present: int
    artifacts_deleted: int
    deletes_kept_pinned: int
    deletes_kept_foreign: int
    artifacts_vanished: int
    artifacts_failed: int
    pages_moved: int
    bytes_moved: int
    pages_resent: int
    bytes_resent: int
    pages_written: int
    bytes_written: int
    retries: int
    last_sequence: int
    elapsed_s: float
    retry_reasons: _containers.RepeatedScalarFieldContainer[str]
    failures: _containers.ScalarMap[str, str]
    artifacts_repaired: int
    repaired: _containers.RepeatedScalarFieldContainer[str]
    expired_not_restored: int
    def __init__(self, source: _Optional[str] = ..., target: _Optional[str] = ..., artifacts_added: _Optional[int] = ..., artifacts_present: _Optional[int] = ..., artifacts_deleted: _Optional[int] = ..., deletes_kept_pinned: _Optional[int] = ..., deletes_kept_foreign: _Optional[int] = ..., artifacts_vanished: _Optional[int] = ..., artifacts_failed: _Optional[int] = ..., pages_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., pages_resent: _Optional[int] = ..., bytes_resent: _Optional[int] = ..., pages_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., retries: _Optional[int] = ..., last_sequence: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., retry_reasons: _Optional[_Iterable[str]] = ..., failures: _Optional[_Mapping[str, str]] = ..., artifacts_repaired: _Optional[int] = ..., repaired: _Optional[_Iterable[str]] = ..., expired_not_restored: _Optional[int] = ...) -> None: ...

class LibraryAddRequest(_message.Message):
    __slots__ = ("problem", "solution", "answer", "verified_by", "tags")
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    SOLUTION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BY_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    problem: str
    solution: str
    answer: str
    verified_by: str
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, problem: _Optional[str] = ..., solution: _Optional[str] = ..., answer: _Optional[str] = ..., verified_by: _Optional[str] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class LibraryAddResponse(_message.Message):
    __slots__ = ("entry", "receipt", "already_present")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    entry: LibraryEntry
    receipt: Receipt
    already_present: bool
    def __init__(self, entry: _Optional[_Union[LibraryEntry, _Mapping]] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ..., already_present: _Optional[bool] = ...) -> None: ...

class LibraryEntry(_message.Message):
    __slots__ = ("artifact_id", "problem", "answer", "verified_by", "tags", "problem_tokens", "num_tokens", "created_unix_ms", "solution")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BY_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SOLUTION_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    problem: str
    answer: str
    verified_by: str
    tags: _containers.RepeatedScalarFieldContainer[str]
    problem_tokens: int
    num_tokens: int
    created_unix_ms: int
    solution: str
    def __init__(self, artifact_id: _Optional[str] = ..., problem: _Optional[str] = ..., answer: _Optional[str] = ..., verified_by: _Optional[str] = ..., tags: _Optional[_Iterable[str]] = ..., problem_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., solution: _Optional[str] = ...) -> None: ...

class LibraryListRequest(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: str
    def __init__(self, tag: _Optional[str] = ...) -> None: ...

class LibraryListResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LibraryEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[LibraryEntry, _Mapping]]] = ...) -> None: ...

class LibraryRemoveRequest(_message.Message):
    __slots__ = ("artifact_id",)
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    def __init__(self, artifact_id: _Optional[str] = ...) -> None: ...

class LibraryRemoveResponse(_message.Message):
    __slots__ = ("artifact_id", "pages_freed", "bytes_freed")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    pages_freed: int
    bytes_freed: int
    def __init__(self, artifact_id: _Optional[str] = ..., pages_freed: _Optional[int] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class AskRequest(_message.Message):
    __slots__ = ("text", "max_new_tokens", "library_tag", "no_recall")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_TAG_FIELD_NUMBER: _ClassVar[int]
    NO_RECALL_FIELD_NUMBER: _ClassVar[int]
    text: str
    max_new_tokens: int
    library_tag: str
    no_recall: bool
    def __init__(self, text: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., library_tag: _Optional[str] = ..., no_recall: _Optional[bool] = ...) -> None: ...

class AskResponse(_message.Message):
    __slots__ = ("answer", "path", "entry_id", "verified_answer", "matches_verified", "decode_tokens", "receipt", "wall_s", "cpu_s", "library_artifact_id", "library_built")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    MATCHES_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_BUILT_FIELD_NUMBER: _ClassVar[int]
    answer: str
    path: AskPath
    entry_id: str
    verified_answer: str
    matches_verified: bool
    decode_tokens: int
    receipt: Receipt
    wall_s: float
    cpu_s: float
    library_artifact_id: str
    library_built: bool
    def __init__(self, answer: _Optional[str] = ..., path: _Optional[_Union[AskPath, str]] = ..., entry_id: _Optional[str] = ..., verified_answer: _Optional[str] = ..., matches_verified: _Optional[bool] = ..., decode_tokens: _Optional[int] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ..., wall_s: _Optional[float] = ..., cpu_s: _Optional[float] = ..., library_artifact_id: _Optional[str] = ..., library_built: _Optional[bool] = ...) -> None: ...

class RemoteStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoteStatusResponse(_message.Message):
    __slots__ = ("enabled", "endpoint", "bucket", "prefix", "write_mode", "reachable", "backlog_artifacts", "uploaded_artifacts", "uploaded_pages", "uploaded_bytes", "downloaded_pages", "downloaded_bytes", "hits", "misses", "corrupt_objects", "last_error", "last_error_unix_ms", "retry_in_s")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    WRITE_MODE_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_PAGES_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RETRY_IN_S_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    endpoint: str
    bucket: str
    prefix: str
    write_mode: str
    reachable: bool
    backlog_artifacts: int
    uploaded_artifacts: int
    uploaded_pages: int
    uploaded_bytes: int
    downloaded_pages: int
    downloaded_bytes: int
    hits: int
    misses: int
    corrupt_objects: int
    last_error: str
    last_error_unix_ms: int
    retry_in_s: float
    def __init__(self, enabled: _Optional[bool] = ..., endpoint: _Optional[str] = ..., bucket: _Optional[str] = ..., prefix: _Optional[str] = ..., write_mode: _Optional[str] = ..., reachable: _Optional[bool] = ..., backlog_artifacts: _Optional[int] = ..., uploaded_artifacts: _Optional[int] = ..., uploaded_pages: _Optional[int] = ..., uploaded_bytes: _Optional[int] = ..., downloaded_pages: _Optional[int] = ..., downloaded_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., corrupt_objects: _Optional[int] = ..., last_error: _Optional[str] = ..., last_error_unix_ms: _Optional[int] = ..., retry_in_s: _Optional[float] = ...) -> None: ...

class RemoteSyncRequest(_message.Message):
    __slots__ = ("push", "pull")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    push: bool
    pull: bool
    def __init__(self, push: _Optional[bool] = ..., pull: _Optional[bool] = ...) -> None: ...

class RemoteSyncResponse(_message.Message):
    __slots__ = ("pushed_artifacts", "pushed_pages", "pushed_bytes", "pulled_artifacts", "pulled_pages", "pulled_bytes", "in_both", "failures", "backlog_artifacts")
    PUSHED_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PUSHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULLED_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    PULLED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_BOTH_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    pushed_artifacts: int
    pushed_pages: int
    pushed_bytes: int
    pulled_artifacts: int
    pulled_pages: int
    pulled_bytes: int
    in_both: int
    failures: _containers.RepeatedScalarFieldContainer[str]
    backlog_artifacts: int
    def __init__(self, pushed_artifacts: _Optional[int] = ..., pushed_pages: _Optional[int] = ..., pushed_bytes: _Optional[int] = ..., pulled_artifacts: _Optional[int] = ..., pulled_pages: _Optional[int] = ..., pulled_bytes: _Optional[int] = ..., in_both: _Optional[int] = ..., failures: _Optional[_Iterable[str]] = ..., backlog_artifacts: _Optional[int] = ...) -> None: ...
