"""Tiny random models of each family the exact forward takes, for tests without downloads.

`--model tiny:FAMILY:SEED` (e.g. tiny:gemma3:1) names one: a model built from a
transformers config of that family (`FAMILIES` below: 64 values a row, 2-3 layers,
GQA, sliding windows of 8 positions, soft caps small enough to bend the scores),
its weights drawn from SEED so that activations stay of order one (norm weights,
biases and all), written once into the model cache as a safetensors directory
(`save_pretrained`) and as a GGUF file (gguf-py's writer, the tensors named and laid out
as llama.cpp's converter writes them: the projections in Q8_0 and the MLP's in Q4_1
blocks, Llama's q and k rows in llama.cpp's rotary order, Gemma's norms as 1 + w).
`tiny_files(family, seed, cache)` returns both paths. The adapter loads the directory
for tiny:FAMILY:SEED (the model as defined here); `--model PATH.gguf` loads the GGUF
(transformers reads its metadata and dequantizes its blocks: the config keys a GGUF
holds for the family, the others the config class's defaults, so it is a model of its
own), whose blocks the products then stream. Neither has a tokenizer: requests send
token ids.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from kvgraftd.config import TINY_FAMILIES

SHAPE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 1 << 20,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip
WINDOW = 8
FAMILIES = {
    "llama": ("LlamaConfig", {"num_hidden_layers": 2, "head_dim": 16}),
    "mistral": (
        "MistralConfig",
        {"num_hidden_layers": 2, "head_dim": 16, "sliding_window": WINDOW},
    ),
    # Qwen 2's window on its layers from max_window_layers (off in the released models)
    "qwen2": (
        "Qwen2Config",
        {
            "num_hidden_layers": 2,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
        },
    ),
    # a head of 128 (Qwen 3's own, and the one its GGUF metadata cannot say otherwise)
    "qwen3": ("Qwen3Config", {"num_hidden_layers": 2, "head_dim": 128}),
    "gemma2": (
        "Gemma2Config",
        {
            "num_hidden_layers": 2,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 6.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "phi3": ("Phi3Config", {"num_hidden_layers": 2}),
}
assert tuple(FAMILIES) == TINY_FAMILIES, "the families --model tiny:FAMILY:SEED names"
TIED = frozenset({"gemma2", "gemma3", "qwen2"})  # as the small models of these families are


def parse(spec: str) -> tuple[str, int]:
    """'FAMILY:SEED' -> (family, seed); a bare SEED is the Llama built in memory (family "")."""
    family, _, seed = spec.rpartition(":")
    if family and family not in FAMILIES:
        raise ValueError(f"no tiny {family!r} model: use one of {', '.join(FAMILIES)}")
    if not seed.isdigit():
        raise ValueError(f"tiny:{spec}: the seed is a number (e.g. tiny:{family or 'llama'}:1)")
    return family, int(seed)


def build(family: str, seed: int, **overrides):
    """The family's tiny model, its weights drawn from `seed` (float32, eval mode);
    `overrides`: config keys of another value (e.g. sliding_window=16)."""
    import transformers

    class_name, extra = FAMILIES[family]
    tied = family in TIED  # the output product reads the embedding's table
    settings = {**SHAPE, **extra, "tie_word_embeddings": tied, **overrides}
    config = getattr(transformers, class_name)(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() == 2:  # products of order one: 1 / sqrt(fan in)
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))
            elif name.endswith("norm.weight"):  # around Gemma's 0 (1 + w), the others' 1
                parameter.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.2 * noise)
            else:  # biases
                parameter.copy_(0.3 * noise)
    return model.eval()


def tiny_files(
    family: str, seed: int, cache: Path, vocab_size: int | None = None
) -> tuple[Path, Path]:
    """(safetensors directory, GGUF file) of the tiny model, written once into `cache`;
    `vocab_size`: another vocabulary's size (a real tokenizer's, daemon --tokenizer)."""
    import transformers

    shape = {**SHAPE, "vocab_size": vocab_size or SHAPE["vocab_size"]}
    # named by what makes it: another definition here or another converter is another model
    made_of = repr((FAMILIES[family], shape, family in TIED, transformers.__version__))
    home = cache / "tiny" / f"{family}-{seed}-{hashlib.sha256(made_of.encode()).hexdigest()[:12]}"
    if not (home / "model.gguf").exists():
        partial = home.with_name(f"{home.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        model = build(family, seed, vocab_size=shape["vocab_size"])
        model.save_pretrained(partial / "safetensors")
        write_gguf(model, family, partial / "model.gguf")
        home.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(partial, home)
        except OSError:  # another process wrote it first (a non-empty directory)
            shutil.rmtree(partial, ignore_errors=True)
    return home / "safetensors", home / "model.gguf"


def write_gguf(model, family: str, path: Path) -> None:
    """`model` (of `family`) as llama.cpp's converter would write it, in Q8_0 and Q4_1 blocks
    (bench/family_bench.py writes its models with it too)."""
    import gguf

    config = model.config
    # llama.cpp's architecture: the family's, but a Mistral's is "llama" (told apart by name)
    architecture = "llama" if family == "mistral" else family
    writer = gguf.GGUFWriter(str(path), architecture)
    # (transformers reads a "llama" file named "mistral" as a Mistral, then finds no Mistral in
    # gguf-py 0.18's names: a Mistral's GGUF loads as the Llama it is, but for its window)
    writer.add_name(f"tiny-{family}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_pad_token_id(config.vocab_size - 1)  # a config's default may lie past the vocabulary
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    if family.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
    layers = config.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.upper()], layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the embedding's table
        stem, _, suffix = name.rpartition(".")
        data = tensor.detach().to(torch.float32).numpy()
        target = names.get_name(stem)
        if target is None:
            raise ValueError(f"gguf-py names no tensor for {name}")
        if architecture == "llama" and target.endswith(("attn_q", "attn_k")):
            data = _permuted(data, heads if target.endswith("attn_q") else kv_heads)
        if family.startswith("gemma") and target.endswith("norm"):
            data = data + np.float32(1)
        _add(writer, f"{target}.{suffix}", data, gguf)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer, name: str, data: np.ndarray, gguf) -> None:
    """A matrix in blocks (the MLP's Q4_1, the others' Q8_0), anything else in float32."""
    if data.ndim != 2:
        writer.add_tensor(name, np.ascontiguousarray(data))
        return
    kind = gguf.GGMLQuantizationType.Q4_1 if ".ffn_" in name else gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(np.ascontiguousarray(data), kind)
    writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)


def _permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary order of q's or k's rows (transformers reverses it when it loads)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
