"""The model fingerprint: which model a KV artifact belongs to.

`model_fingerprint(model, tokenizer)` is a SHA-256 over the weights (sorted names, dtypes,
shapes, bytes), the config keys that decide what a Llama computes, the tokenizer (a GGUF
file's: the digest of its vocabulary and template, whatever library builds it; a model
directory's: transformers' description of it and its template) and the KV dtype, and,
where a family computes more than those keys say (sliding windows, soft caps, another
activation or attention scaling: `computed_beyond_config`), that too; a Llama's
fingerprint names nothing more. `cached_fingerprint` computes it once per model
source, kept beside the converted model (written whole or not at all).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from kvgraftd.engine.model.families import Family


def cached_fingerprint(model, tokenizer, cache: Path | None) -> bytes:
    if cache is not None and cache.exists():
        return bytes.fromhex(json.loads(cache.read_text())["fingerprint"])
    fingerprint = model_fingerprint(model, tokenizer)
    if cache is not None:  # whole or not at all: other processes may read it meanwhile
        partial = cache.with_name(f"{cache.name}.{os.getpid()}")
        partial.write_text(json.dumps({"fingerprint": fingerprint.hex()}))
        os.replace(partial, cache)
    return fingerprint


def computed_beyond_config(model) -> dict[str, Any]:
    """What the family computes that a Llama of the keys hashed above would not: each
    layer's sliding window, the soft caps, the activation, attention's scaling (the
    weights name the rest: biases, head norms, the norms after attention and the MLP)."""
    family = Family.of(model)
    computed: dict[str, Any] = {}
    if any(family.windows):
        computed["windows"] = list(family.windows)
    if family.attention_softcap or family.final_softcap:
        computed["softcaps"] = [family.attention_softcap, family.final_softcap]
    if family.activation != "silu":
        computed["activation"] = family.activation
    head_dim = getattr(model.config, "head_dim", None)
    head_dim = head_dim or model.config.hidden_size // model.config.num_attention_heads
    layers = getattr(getattr(model, "model", None), "layers", [])
    scalings = {float(getattr(layer.self_attn, "scaling", head_dim**-0.5)) for layer in layers}
    if scalings - {head_dim**-0.5}:
        computed["scaling"] = sorted(scalings)
    return computed


def model_fingerprint(model, tokenizer) -> bytes:
    """SHA-256 of weights (sorted names, dtypes, shapes, bytes), config, tokenizer, KV dtype."""
    digest = hashlib.sha256(b"kvgraft-fingerprint/1\0")
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}\0".encode())
        if tensor.numel():
            digest.update(tensor.view(torch.uint8).numpy())
    config = model.config
    described = {
        key: getattr(config, key, None)
        for key in (
            "model_type",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_size",
            "rope_theta",
            "rope_parameters",
            "rope_scaling",
            "rms_norm_eps",
            "vocab_size",
            "tie_word_embeddings",
        )
    }
    digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    computed = computed_beyond_config(model)
    if computed:  # what a Llama computes the keys above name (its fingerprints stay)
        digest.update(json.dumps(computed, sort_keys=True).encode())
    definition = getattr(tokenizer, "definition_digest", None)
    if definition is not None:  # a GGUF file's (kvgraft.text): its vocabulary and template
        digest.update(b"vocabulary\0" + definition())
    elif tokenizer is not None:  # a model directory's transformers tokenizer
        digest.update(
            tokenizer.backend_tokenizer.to_str().encode()
            if hasattr(tokenizer, "backend_tokenizer")
            else b""
        )
        digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    digest.update(struct.pack("<I", 4) + b"float32")  # the KV dtype the engine keeps
    return digest.digest()
