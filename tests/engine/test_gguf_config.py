"""A GGUF model's configuration from its metadata alone, held to what transformers reads.

For every tiny family's GGUF file and the default model, `GgufConfig.of` must give the
family, the geometry, each layer's window, the soft caps, the norms' epsilon, the scale of
the attention scores, whether the output product is tied, and each layer's rotary
frequencies (computed from the file's base as transformers computes them, compared with
torch.equal) exactly as the model transformers loads from the same file has them
(kvgraftd.engine.model.families reads those off the loaded modules): the configuration a
torch-free forward will compute with. An architecture of no family is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFWriter

from kvgraft.text.default_model import default_model_path
from kvgraft.text.gguf_metadata import read_header
from kvgraftd.engine.model import tiny_models
from kvgraftd.engine.model.families import Family
from kvgraftd.engine.model.gguf_config import GgufConfig
from tests.conftest import MODEL_CACHE


def _inv_freq(theta: float, dims: int) -> torch.Tensor:
    """transformers' default rotary frequencies for a base and a head's rotated values."""
    exponents = torch.arange(0, dims, 2, dtype=torch.int64).to(dtype=torch.float) / dims
    return 1.0 / (theta**exponents)


def _assert_the_same(ours: GgufConfig, model) -> None:
    config, family = model.config, Family.of(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (ours.family, ours.layers, ours.hidden, ours.intermediate) == (
        family.name, config.num_hidden_layers, config.hidden_size, config.intermediate_size
    )  # fmt: skip
    assert (ours.heads, ours.kv_heads, ours.head_dim, ours.vocab_size) == (
        config.num_attention_heads, config.num_key_value_heads, head_dim, config.vocab_size
    )  # fmt: skip
    assert ours.windows == family.windows
    softcaps = (family.attention_softcap, family.final_softcap)
    assert (ours.attention_softcap, ours.final_softcap) == softcaps
    assert ours.rms_eps == family.eps
    assert ours.query_scale == model.model.layers[0].self_attn.scaling
    assert ours.tied == config.tie_word_embeddings
    for layer, kind in enumerate(family.rope_types):
        theta = ours.local_rope_theta if ours.windows[layer] else ours.rope_theta
        expected = family.rope_tables[kind].inv_freq
        assert torch.equal(_inv_freq(theta, ours.rotary_dims), expected), f"layer {layer}"


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_each_familys_config_is_the_one_transformers_reads_from_the_file(family: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_models.tiny_files(family, 1, MODEL_CACHE)[1]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    _assert_the_same(GgufConfig.of(read_header(path)), model)


def test_the_default_models_config_is_the_served_models(real_model) -> None:
    _assert_the_same(GgufConfig.of(read_header(default_model_path())), real_model.model)


def test_an_architecture_of_no_family_is_refused_by_name(tmp_path) -> None:
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'mamba'.*computes llama"):
        GgufConfig.of(read_header(tmp_path / "m.gguf"))
