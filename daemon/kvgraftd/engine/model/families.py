"""The decoder families the row-invariant forward computes, read from a transformers model.

`Family.of(model)` says which family a loaded causal LM is and what its layers do, in
the terms kvgraftd.engine.model.native_forward computes them:

* llama (and SmolLM), mistral: RMS norms, SiLU-gated MLP, rotary positions; mistral
  with a sliding window;
* qwen2 (Qwen 2 and 2.5): q, k and v biases, a window on the layers from max_window_layers
  where use_sliding_window says so; qwen3: an RMS norm on each query and key head;
* gemma2, gemma3 (gemma3_text): norms that scale by (1 + w), a GELU-tanh gated MLP, the
  embedding scaled by the square root of the hidden size, norms after attention and
  after the MLP too, sliding-window layers among global ones (gemma3: with their own
  rotary base), gemma2's soft caps on attention scores and final logits;
* phi3: q, k and v as one fused projection, gate and up as another.

`missing` lists what the exact forward lacks for this model (an unknown family, a
rotary scaling that moves with the length, a partial rotary, more than one norm
epsilon); empty where it takes it. Biases are taken on any product of any family (Qwen
2's on q, k and v; a Llama's with attention_bias or mlp_bias). The per-layer facts
(`windows`, `rope_types`, `rope_tables`) are the model's own modules' values, not
defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# model_type -> the family's name as `kvgraft info` shows it
FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    # (a "gemma3" checkpoint is Gemma 3 with its vision tower: refused, of no family here)
}
GEMMA = frozenset({"gemma2", "gemma3"})
STATIC_ROPE = frozenset({"default", "linear", "llama3"})  # inv_freq fixed at load
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class RopeTable:
    """A rotary embedding's inverse frequencies and the factor its cos and sin carry."""

    inv_freq: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class Family:
    name: str  # FAMILIES' name, or the model_type of a model no family takes
    missing: tuple[str, ...]  # what the exact forward lacks for it (empty: it takes it)
    activation: str  # "silu" or "gelu_tanh"
    norm_offset: float  # a norm multiplies by (offset + w): 1 in Gemma, else 0
    biases: bool  # on any product but the logits
    qk_norm: bool
    sandwich_norms: bool  # norms on attention's and the MLP's outputs too (Gemma)
    windows: tuple[int, ...]  # each layer's sliding window (0: every position)
    attention_softcap: float  # 0: none
    final_softcap: float  # 0: none
    rope_types: tuple[str, ...]  # each layer's key into rope_tables
    rope_tables: dict[str, RopeTable]
    fused: bool  # q, k, v one weight and gate, up another (Phi-3)
    eps: float

    @classmethod
    def of(cls, model) -> Family:
        config = model.config
        model_type = getattr(config, "model_type", "")
        if model_type not in FAMILIES:
            return cls._unknown(config, model_type)
        name = FAMILIES[model_type]
        decoder = model.model
        layers = list(decoder.layers)
        missing: list[str] = []
        attentions = [layer.self_attn for layer in layers]
        activation = ACTIVATIONS.get(
            getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        )
        if activation is None:
            missing.append(f"the activation {getattr(config, 'hidden_act', None)!r}")
        biases = _biases(layers[0])
        tables, rope_types = _rope(decoder, config, len(layers), missing)
        eps = _epsilons(decoder, layers)
        if len(eps) > 1:
            missing.append(f"norms with different epsilons {sorted(eps)}")
        gemma = name in GEMMA
        return cls(
            name=name,
            missing=tuple(missing),
            activation=activation or "",
            norm_offset=1.0 if gemma else 0.0,
            biases=biases,
            qk_norm=bool(attentions) and getattr(attentions[0], "q_norm", None) is not None,
            sandwich_norms=gemma,
            windows=tuple(_window(attention, config) for attention in attentions),
            attention_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0)
            if name == "gemma2"
            else 0.0,
            final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0),
            rope_types=rope_types,
            rope_tables=tables,
            fused=bool(attentions) and hasattr(attentions[0], "qkv_proj"),
            eps=next(iter(eps)),
        )

    @classmethod
    def _unknown(cls, config, model_type: str) -> Family:
        """A model of no family here: what its config (or its text model's, in a multimodal
        one) says of its attention (a window or a soft cap: torch's fixed schedule would leave
        them out, so the adapter refuses it)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = getattr(text, "num_hidden_layers", None) or getattr(config, "num_hidden_layers", 0)
        window = getattr(text, "sliding_window", None) or 0
        if not getattr(text, "use_sliding_window", True):
            window = 0
        config = text
        return cls(
            name=model_type, missing=(f"the {model_type!r} architecture",), activation="",
            norm_offset=0.0, biases=False, qk_norm=False, sandwich_norms=False,
            windows=(int(window),) * layers,
            attention_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0),
            final_softcap=0.0, rope_types=(), rope_tables={}, fused=False, eps=0.0,
        )  # fmt: skip


def _biases(layer) -> bool:
    """Whether a layer's products add biases (a family's layers all do, or none)."""
    products = [*layer.self_attn.children(), *layer.mlp.children()]
    return any(getattr(module, "bias", None) is not None for module in products)


def _window(attention, config) -> int:
    """A layer's sliding window: its module's where it keeps one (Gemma, Qwen: per layer),
    else the config's (Mistral, Phi-3: every layer)."""
    if hasattr(attention, "sliding_window"):
        return int(attention.sliding_window or 0)
    return int(getattr(config, "sliding_window", None) or 0)


def _rope(decoder, config, layers: int, missing: list[str]):
    """The rotary tables by name and each layer's: one ("") for most, one per layer type
    for Gemma 3 (its local layers' own base)."""
    rotary = decoder.rotary_emb
    kinds = rotary.rope_type if isinstance(rotary.rope_type, dict) else {"": rotary.rope_type}
    tables = {}
    for kind, rope_type in kinds.items():
        if rope_type not in STATIC_ROPE:
            missing.append(f"the rotary scaling {rope_type!r}")
        prefix = f"{kind}_" if kind else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq")
        scaling = float(getattr(rotary, f"{prefix}attention_scaling"))
        tables[kind] = RopeTable(inv_freq.detach().to(torch.float32).clone(), scaling)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if any(2 * table.inv_freq.numel() != head_dim for table in tables.values()):
        missing.append("a partial rotary embedding")
    if list(kinds) == [""]:
        return tables, ("",) * layers
    return tables, tuple(config.layer_types[:layers])


def _epsilons(decoder, layers) -> set[float]:
    norms = [decoder.norm]
    for layer in layers:
        norms += [module for name, module in layer.named_modules() if name.endswith("norm")]
    return {float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0))) for norm in norms}
