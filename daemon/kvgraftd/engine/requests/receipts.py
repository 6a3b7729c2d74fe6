"""Receipts: the hashes that prove a computation, and the profile that makes it repeatable.

input_sha256 = SHA-256("kvgraft-input/1" | n | token ids | m | segment ends),
all little-endian u32. Logits are hashed as float32 little-endian bytes:
prompt_logits_sha256 over the vector at the last prompt position,
generated_logits_sha256 over the vectors of every generated step, in order.
The compute profile names what must match for two runs to agree to the bit.
"""

from __future__ import annotations

import hashlib
import os
import platform
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.model import decode_attention

if TYPE_CHECKING:  # the model's module loads transformers; the profile needs only the shape
    from kvgraftd.engine.model.geometry import ModelGeometry

ATTENTION = "kvgraft-blockwise-online-softmax"
# its arithmetic's version by the kernel that decodes: the native kernel's second (FMA chains,
# attend_kernel.h); torch's own operations (online_softmax.py) are still the first's
ATTENTION_VERSIONS = {"native": 2, "torch": 1}


def pin_determinism() -> None:
    """The settings every exact run needs (docs/architecture.md); asserted, not assumed."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    torch.use_deterministic_algorithms(True)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
    assert torch.are_deterministic_algorithms_enabled()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_CPU = torch.device("cpu")


def compute_profile(
    page_tokens: int,
    block_tokens: int,
    geometry: ModelGeometry,
    device: torch.device = _CPU,
    products: str = "",
) -> pb.ComputeProfile:
    """`products`: the row-invariant forward's (kvgraftd.engine.model.native_forward names
    them), "" on the fixed schedule (torch's). The row-invariant arithmetic calls no C
    library's transcendental function (its exp, sin and cos are the kernels' own; fmaf, where
    called, is exact by IEEE 754), so the profile names none: a receipt re-checks on any
    x86-64 Linux with the same names."""
    on_cuda = device.type == "cuda"
    shape = geometry.num_heads, geometry.kv_heads, geometry.head_dim
    decode = "torch" if on_cuda else decode_attention.kernel_for(*shape)  # decoding's last bits
    return pb.ComputeProfile(
        torch_version=torch.__version__,
        device_kind=device.type,
        device_name=torch.cuda.get_device_name(device) if on_cuda else cpu_name(),
        compute_dtype="float32",
        attention=f"{ATTENTION}/{ATTENTION_VERSIONS[decode]} block={block_tokens} decode={decode}",
        page_tokens=page_tokens,
        products=products,
    )


def input_sha256(token_ids: Sequence[int], segment_ends: Sequence[int]) -> bytes:
    digest = hashlib.sha256(b"kvgraft-input/1\0")
    for values in (token_ids, segment_ends):
        digest.update(struct.pack("<I", len(values)))
        digest.update(np.asarray(values, dtype="<u4").tobytes())
    return digest.digest()


def logits_bytes(logits: torch.Tensor) -> bytes:
    return logits.detach().to(torch.float32).numpy().astype("<f4", copy=False).tobytes()


def logits_view(logits: torch.Tensor) -> memoryview:
    """The bytes of `logits_bytes`, without a copy (float32 CPU logits, as the forward gives)."""
    return memoryview(logits.detach().to(torch.float32).numpy().astype("<f4", copy=False)).cast("B")


def logits_sha256(logits: torch.Tensor) -> bytes:
    return hashlib.sha256(logits_bytes(logits)).digest()
