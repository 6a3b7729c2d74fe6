"""The model adapter: the module that loads models through transformers (with tiny_models, which
builds its test models with it, and model_tokenizer, for a model directory's tokenizer, the
only ones that import it; a GGUF file's tokenizer and template are kvgraft.text's).

It loads a causal LM (the default GGUF of SmolLM2-135M-Instruct, any GGUF
file, a Hugging Face model directory, a tiny seeded random Llama for tests
(tiny:SEED), or a tiny random model of another family written as safetensors and
GGUF (tiny:FAMILY:SEED, kvgraftd.engine.model.tiny_models)), caches GGUF conversions as
safetensors, computes the model
fingerprint once per model source, and runs one forward pass of a chunk of
tokens at explicit positions with kvgraft's own attention: transformers
computes projections, RoPE, norms and MLPs; attention and the KV it reads are
delegated to the `KvContext` passed in (registered as the attention
implementation "kvgraft", with no mask: the context applies causality). On
CPU, a model kvgraftd.engine.model.native_forward supports runs there instead, with
row-invariant products (`row_invariant`): then a position's bits depend on
the tokens up to it alone, not on how the passes were cut. A model whose
attention only that forward computes (sliding windows, soft caps) is refused
where it cannot run there, with what is missing named; any other runs on
torch's fixed schedule, and `schedule` says which.

Contract: `forward` returns the float32 logits of the chunk's last position
(or of every position); the same tokens, positions and context bytes give the
same logits bits. It must not keep state between calls: everything lives in
the context.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jinja2
import torch
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
from transformers.masking_utils import AttentionMaskInterface

from kvgraft.errors import FailedPrecondition, InvalidArgument
from kvgraft.text.chat_template import TemplateFailure
from kvgraft.text.chat_tokens import ChatTokens, TransformersText
from kvgraft.text.default_model import default_model_path
from kvgraftd.engine.model import model_tokenizer, native_forward, tiny_models
from kvgraftd.engine.model.families import Family
from kvgraftd.engine.model.fingerprint import cached_fingerprint
from kvgraftd.engine.model.geometry import ModelGeometry

log = logging.getLogger(__name__)

ATTENTION_NAME = "kvgraft"
TINY_PREFIX = "tiny:"
_CONTEXT_KWARG = "kvgraft_context"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface → KvContext.attend (query/key/value: [1, heads, n, D])."""
    context = kwargs[_CONTEXT_KWARG]
    output = context.attend(module.layer_idx, query[0], key[0], value[0], scaling)
    return output.unsqueeze(0), None  # [1, n, heads, D]


AttentionInterface.register(ATTENTION_NAME, _attention)
AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)


class ModelAdapter:
    """A loaded causal LM and its tokenizer, float32 on CPU, in eval mode."""

    def __init__(self, model, tokenizer, name: str, fingerprint: bytes) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.fingerprint = fingerprint
        config = model.config
        num_heads = config.num_attention_heads
        self.family = Family.of(model)
        self.geometry = ModelGeometry(
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            vocab_size=config.vocab_size,
            windows=self.family.windows if any(self.family.windows) else (),
            softcap=self.family.attention_softcap,
        )
        self.eos_token_ids = model_tokenizer.end_of_generation(config, tokenizer)
        self.device = torch.device("cpu")
        self.native: native_forward.NativeForward | None = None
        self.gguf_path: Path | None = None  # the GGUF file the model came from, if one
        self._chat: tuple[Any, TransformersText, ChatTokens] | None = None  # (its tokenizer, ...)
        self._stability: str | None = None  # template_stability, once asked

    @property
    def row_invariant(self) -> bool:
        """Whether forward passes run with row-invariant products (any schedule is exact)."""
        return self.native is not None

    @property
    def schedule(self) -> str:
        """ "any" where every schedule gives the same bits (the row-invariant forward),
        "fixed" where the engine keeps one (torch's products), with what the row-invariant
        forward lacks for this model."""
        if self.native is not None:
            return "any"
        lacking = native_forward.missing(self.model) if self.device.type == "cpu" else []
        return "fixed" + (f" ({'; '.join(lacking)})" if lacking else " (not on CPU)")

    @property
    def products(self) -> str:
        """The products' arithmetic as the compute profile names it ("" on the fixed
        schedule: torch's)."""
        return self.native.products_profile if self.native is not None else ""

    # ------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        source: str | None,
        cache_dir: Path,
        device: str = "cpu",
        products: str = "int8-dot",
        chat_template: str = "",
        tokenizer: str = "",
    ) -> ModelAdapter:
        """Load `source`: None (default model), 'tiny:SEED', 'tiny:FAMILY:SEED', a GGUF file or
        an HF directory; `products`: the CPU forward's arithmetic over a GGUF file's blocks
        (native_forward); `chat_template`: a template's source to use instead of the
        model's own; `tokenizer`: a GGUF file whose tokenizer (and template) to use instead
        of the model's own (a tiny model is built with its vocabulary's size)."""
        started = time.monotonic()
        gguf_path = None
        text = model_tokenizer.load(Path(tokenizer)) if tokenizer else None
        if tokenizer and text is None:
            raise InvalidArgument(f"{tokenizer} holds no tokenizer (no tokenizer.ggml.model)")
        vocab_size = len(text) if text is not None else None
        family, seed = cls._tiny_spec(source)
        if source and source.startswith(TINY_PREFIX) and not family:
            adapter = cls._tiny(seed, text)
        else:
            if family:  # written here: no download, no default model needed
                path = tiny_models.tiny_files(family, seed, cache_dir, vocab_size)[0]
            else:
                path = Path(source) if source else default_model_path()
            if not path.exists():
                raise InvalidArgument(
                    f"model {path} does not exist; pass a GGUF file or an HF directory"
                )
            adapter = cls._load_path(path, cache_dir, text)
            gguf_path = None if path.is_dir() else path
            if family:
                adapter.name = source
        if text is not None and len(text) > adapter.geometry.vocab_size:
            raise InvalidArgument(
                f"the tokenizer of {tokenizer} has {len(text)} tokens, more than the model's "
                f"vocabulary of {adapter.geometry.vocab_size}: give the model's own"
            )
        if device != "cpu":
            adapter.model.to(device)
        elif native_forward.supports(adapter.model):
            adapter.native = native_forward.NativeForward(adapter.model, gguf_path, products)
        if adapter.native is None and not adapter.geometry.plain_attention:
            lacking = native_forward.missing(adapter.model) if device == "cpu" else ["a CPU"]
            raise FailedPrecondition(
                f"{adapter.name} ({adapter.family.name}) attends with sliding windows or soft "
                "caps, which only the row-invariant CPU forward computes; here it lacks "
                f"{'; '.join(lacking)}"
            )
        adapter.gguf_path = gguf_path
        adapter.device = torch.device(device)
        if chat_template:
            adapter.replace_chat_template(chat_template)
        log.info("model %s loaded in %.1f s", adapter.name, time.monotonic() - started)
        return adapter

    def replace_chat_template(self, source: str) -> None:
        """Render conversations with `source` instead of the model's own template."""
        model_tokenizer.replace_template(self.tokenizer, source, self.name)
        self._chat = self._stability = None

    @property
    def template_stability(self) -> str:
        """ "none", "stable" or how the chat template rewrites earlier turns (kvgraft info)."""
        if self._stability is None:
            self._stability = model_tokenizer.template_stability(self.tokenizer, self.name)
        return self._stability

    def release_float_weights(self) -> int:
        """A daemon's forward on the row-invariant kernels reads the GGUF file's blocks, never
        the model's float32 copies of them: they are freed (bytes returned; 0 where the
        model does not run there). Afterwards only the native forward runs this model.

        What the model keeps (the norms; the embedding where it is not read from the tied
        output product's blocks) is copied out of the converted file's mapping, so the
        mapping goes too: its pages counted in the daemon's resident memory."""
        if self.native is None:
            return 0
        freed = self.native.release_model_weights()
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tensor.data = tensor.data.clone()
        return freed

    def with_products(self, products: str) -> ModelAdapter:
        """This model with the row-invariant forward's other products (the same weights,
        packed again): to compare the two, as the tests and bench/quality_bench.py do."""
        if self.native is None:
            raise FailedPrecondition("the model does not run on the row-invariant forward here")
        other = ModelAdapter(self.model, self.tokenizer, self.name, self.fingerprint)
        other.native = native_forward.NativeForward(self.model, self.gguf_path, products)
        other.gguf_path = self.gguf_path
        return other

    @staticmethod
    def _tiny_spec(source: str | None) -> tuple[str, int]:
        """(family, seed) of a tiny:... source ("" and 0 otherwise, and for tiny:SEED's Llama
        its seed)."""
        if not source or not source.startswith(TINY_PREFIX):
            return "", 0
        try:
            return tiny_models.parse(source[len(TINY_PREFIX) :])
        except ValueError as error:
            raise InvalidArgument(str(error)) from None

    @classmethod
    def _tiny(cls, seed: int, tokenizer=None) -> ModelAdapter:
        config = LlamaConfig(
            vocab_size=len(tokenizer) if tokenizer is not None else 512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1 << 20,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=None,
        )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return cls._prepared(model, tokenizer, f"{TINY_PREFIX}{seed}")

    @classmethod
    def _load_path(cls, path: Path, cache_dir: Path, tokenizer=None) -> ModelAdapter:
        """The model at `path` with its own tokenizer, or `tokenizer` (its fingerprint then
        computed, not cached)."""
        if path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            own = tokenizer if tokenizer is not None else model_tokenizer.load(path)
            return cls._prepared(model, own, str(path))
        converted = cache_dir / _source_key(path)
        if not (converted / "config.json").exists():
            log.info("converting %s to float32 safetensors in %s (once)", path.name, converted)
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
            # save_pretrained refuses a GGUF-loaded model while it still carries its quantizer.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            # written aside, then renamed: another process converting the same file at the
            # same time (two daemons sharing the cache) writes its own, and the first wins
            partial = converted.with_name(f"{converted.name}.partial-{os.getpid()}")
            model.save_pretrained(partial)
            try:
                os.replace(partial, converted)
            except OSError:  # the other one's is there (a non-empty directory)
                shutil.rmtree(partial, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
        # the tokenizer is the GGUF file's own (kvgraft.text), hashed into the fingerprint:
        # a cache of the fingerprint names the tokenizer's build it was computed with
        if tokenizer is not None:
            return cls._prepared(model, tokenizer, path.name)
        fingerprint = converted / f"fingerprint-text{model_tokenizer.TEXT_VERSION}.json"
        own = model_tokenizer.load(path)
        return cls._prepared(model, own, path.name, fingerprint_cache=fingerprint)

    @classmethod
    def _prepared(
        cls, model, tokenizer, name: str, fingerprint_cache: Path | None = None
    ) -> ModelAdapter:
        model.eval()
        model.requires_grad_(False)
        model.set_attn_implementation(ATTENTION_NAME)
        fingerprint = cached_fingerprint(model, tokenizer, fingerprint_cache)
        return cls(model, tokenizer, name, fingerprint)

    # ------------------------------------------------------------------
    def forward(
        self, token_ids: list[int], start: int, context: Any, every_row: bool = False
    ) -> torch.Tensor:
        """Logits [vocab] (float32) at the last of `token_ids`, placed at positions start...
        (`every_row`: [n, vocab], on the row-invariant path only)."""
        if self.native is not None:
            return self.native.forward(token_ids, start, context, every_row)
        if every_row:
            raise FailedPrecondition("logits of every row need the row-invariant forward")
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=1,
                **{_CONTEXT_KWARG: context},
            )
        return out.logits[0, -1].float().cpu()

    def encode(
        self, text: str, chat: bool = False, parse_special: bool = True, add_special: bool = False
    ) -> list[int]:
        """The ids of `text`: with `chat`, a user turn of the chat template (its text as
        text: chat_tokens); else a raw prompt, whose control tokens' texts become those
        tokens unless not `parse_special` (a text that comes from a message); `add_special`:
        with the tokenizer's own BOS/EOS around it."""
        if self.tokenizer is None:
            raise InvalidArgument(
                f"model {self.name} has no tokenizer, so it reads no text: send token ids "
                "(kvgraft generate --tokens 1,2,3; token_ids= in Python; a /v1/completions "
                "prompt of ids)"
            )
        if chat:
            return self.chat_tokens([{"role": "user", "content": text}], True)
        return self._chat_parts()[0].encode(text, parse_special, add_special)

    def chat_tokens(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """A conversation's ids: the template's markup its only control tokens
        (kvgraft.text.chat_tokens)."""
        self._chat_template()
        return self._chat_parts()[1].ids(messages, add_generation_prompt)

    def _chat_parts(self) -> tuple[TransformersText, ChatTokens]:
        """The tokenizer as chat_tokens reads it (every encode under its lock), and its
        ChatTokens: made again when the tokenizer is another object (the tests' toy)."""
        if self._chat is None or self._chat[0] is not self.tokenizer:
            text = TransformersText(self.tokenizer)
            template = getattr(self.tokenizer, "chat_template", None) or ""
            self._chat = (self.tokenizer, text, ChatTokens(text, self.render_chat, template))
        return self._chat[1], self._chat[2]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """A conversation ({"role", "content"} dicts) as the chat template's text (what
        tokenizes it is chat_tokens)."""
        self._chat_template()
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except (TemplateFailure, jinja2.TemplateError) as refused:  # raise_exception(...)
            raise InvalidArgument(
                f"the chat template refused the conversation: {refused}"
            ) from None

    def _chat_template(self) -> None:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument(
                f"model {self.name} has no chat template; send plain text (kvgraft generate "
                "--text without --chat; /v1/completions)"
                if self.tokenizer is not None
                else f"model {self.name} has no tokenizer nor chat template, so it reads "
                "neither a conversation nor text: send token ids (kvgraft generate --tokens "
                "1,2,3; token_ids= in Python; a /v1/completions prompt of ids)"
            )

    def decode(self, token_ids: list[int], skip_special: bool = False) -> str:
        """Text of the tokens; with skip_special, control tokens (end of turn, ...) show as ""."""
        if self.tokenizer is None:  # test models: show the ids
            return "".join(f" {token}" for token in token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special)

    def rope_description(self) -> dict[str, Any]:
        config = self.model.config
        return {
            "rope_parameters": getattr(config, "rope_parameters", None),
            "rope_theta": getattr(config, "rope_theta", None),
            "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        }


def _source_key(path: Path) -> str:
    """Names a converted model by its source file's identity and the converter's version."""
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
