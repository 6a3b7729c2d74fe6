"""A GGUF model's configuration read from its metadata alone, as the engine computes it.

Contract: `GgufConfig.of(header)` (a kvgraft.text.gguf_metadata.Header) gives the family
and the geometry a decoder of that file has, with the values transformers' GGUF reader
gives the same file (tests/engine/test_gguf_config.py holds every tiny family's file and
the default model to it), so a forward built from them computes the model the engine
computes today: the architecture's keys (`ARCH.block_count`, `ARCH.attention.head_count`,
...), and where a file is silent the family's defaults as llama.cpp and transformers both
take them (Gemma 2's soft caps of 50 and 30 and attention scale of 1/16, Gemma 3's global
layer every sixth with a rotary base of 1,000,000 and 10,000 on its local ones). A tied
output product is one the file does not hold (`output.weight`). An architecture of no
family here is refused with a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgraft.text.gguf_metadata import Header

# general.architecture -> the family (a Mistral's file says "llama")
FAMILIES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
    "gemma3": "gemma3", "phi3": "phi3",
}  # fmt: skip
GEMMA_SOFTCAPS = (50.0, 30.0)  # attention scores, final logits: Gemma 2's where unsaid
GEMMA_QUERY_SCALAR = 256  # Gemma's query_pre_attn_scalar where unsaid
GEMMA3_GLOBAL_EVERY = 6  # every sixth layer attends globally
GEMMA3_GLOBAL_THETA, GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0
DEFAULT_THETA = 10_000.0


@dataclass(frozen=True)
class GgufConfig:
    family: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dims: int  # of each head (Phi-3 may rotate part of it)
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float  # of the global layers
    local_rope_theta: float  # of the sliding-window layers (Gemma 3's own; else rope_theta)
    windows: tuple[int, ...]  # each layer's sliding window (0: every position)
    attention_softcap: float  # 0: none
    final_softcap: float
    query_scale: float  # the factor of the attention scores: head_dim ** -0.5 but Gemma
    tied: bool  # the output product reads the embedding's table

    @classmethod
    def of(cls, header: Header) -> GgufConfig:
        metadata = header.metadata
        architecture = str(metadata.get("general.architecture", ""))
        family = FAMILIES.get(architecture)
        if family is None:
            raise ValueError(
                f"architecture {architecture!r} (general.architecture) is not one kvgraft "
                f"computes from a GGUF file; it computes {', '.join(FAMILIES)}"
            )

        def key(suffix: str, default=None):
            value = metadata.get(f"{architecture}.{suffix}", default)
            if value is None:
                raise ValueError(f"the file does not give {architecture}.{suffix}")
            return value

        layers, hidden, heads = (
            key("block_count"),
            key("embedding_length"),
            key("attention.head_count"),
        )
        head_dim = int(key("attention.key_length", hidden // heads))
        names = {tensor.name for tensor in header.tensors}
        embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab_default = embedding.shape[1] if embedding else len(tokens or ())
        gemma = family.startswith("gemma")
        window = int(metadata.get(f"{architecture}.attention.sliding_window", 0) or 0)
        theta = float(key("rope.freq_base", _theta_default(family)))
        softcaps = (0.0, 0.0)
        if family == "gemma2":
            softcaps = (
                float(key("attn_logit_softcapping", GEMMA_SOFTCAPS[0])),
                float(key("final_logit_softcapping", GEMMA_SOFTCAPS[1])),
            )
        return cls(
            family=family,
            layers=int(layers),
            hidden=int(hidden),
            intermediate=int(key("feed_forward_length")),
            heads=int(heads),
            kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rotary_dims=int(key("rope.dimension_count", head_dim)),
            vocab_size=int(key("vocab_size", vocab_default)),
            context_length=int(key("context_length")),
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=theta,
            local_rope_theta=GEMMA3_LOCAL_THETA if family == "gemma3" else theta,
            windows=_windows(family, int(layers), window),
            attention_softcap=softcaps[0],
            final_softcap=softcaps[1],
            query_scale=(GEMMA_QUERY_SCALAR if gemma else head_dim) ** -0.5,
            tied="output.weight" not in names,
        )


def _theta_default(family: str) -> float:
    return GEMMA3_GLOBAL_THETA if family == "gemma3" else DEFAULT_THETA


def _windows(family: str, layers: int, window: int) -> tuple[int, ...]:
    if family == "gemma2":  # local and global layers in turn, the first local
        return tuple(window if index % 2 == 0 else 0 for index in range(layers))
    if family == "gemma3":
        every = GEMMA3_GLOBAL_EVERY
        return tuple(0 if (index + 1) % every == 0 else window for index in range(layers))
    return (window,) * layers  # a Mistral's window on every layer, or none
