"""A GGUF model read in place: every tensor where gguf-py finds it, as a view of the file.

The default model's 272 tensors are compared with gguf-py's GGUFReader (llama.cpp's own
reader): the same names, types, shapes and bytes, held as read-only views of one mapping
(no copy); their weights equal gguf-py's dequantization. A tensor of a type the engine does
not read, rows that are not whole blocks, and a file cut short are refused at open,
naming the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from kvgraft.text.default_model import default_model_path
from kvgraft.text.gguf_metadata import read_header
from kvgraftd.engine.model import gguf_blocks
from kvgraftd.engine.model.gguf_file import GgufFile

pytestmark = pytest.mark.skipif(not gguf_blocks.TYPES, reason="native library not built")


def test_the_default_models_tensors_are_gguf_pys_in_place() -> None:
    path = default_model_path()
    ours = GgufFile.open(path)
    reference = GGUFReader(str(path))
    assert sorted(ours.names()) == sorted(t.name for t in reference.tensors)
    assert ours.metadata["general.architecture"] == "llama"
    checked_types = set()
    for theirs in reference.tensors:
        tensor = ours.tensor(theirs.name)
        assert tensor.type == theirs.tensor_type.value
        assert tensor.shape == tuple(int(n) for n in reversed(theirs.shape))
        assert np.array_equal(tensor.data, theirs.data.reshape(-1).view(np.uint8))
        assert not tensor.data.flags.writeable and not tensor.data.flags.owndata
        if tensor.type not in checked_types:  # one tensor of each type, dequantized
            checked_types.add(tensor.type)
            expected = np.asarray(gguf_dequantize(theirs.data, theirs.tensor_type), np.float32)
            got = ours.dequantized(theirs.name)
            assert got.shape == tensor.shape
            assert np.array_equal(got.view(np.uint32), expected.reshape(got.shape).view(np.uint32))
    assert checked_types == {0, 3, 8}  # F32 norms, Q4_1 and Q8_0 products


def _write(path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]):
    writer = GGUFWriter(str(path), "llama")
    for name, (data, raw_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_what_the_engine_cannot_read_is_refused_at_open_naming_the_tensor(tmp_path) -> None:
    q8 = np.zeros((4, 34), np.uint8)  # 4 rows of one Q8_0 block: (4, 32) weights
    fine = _write(tmp_path / "fine.gguf", {"w": (q8, GGMLQuantizationType.Q8_0)})
    assert GgufFile.open(fine).tensor("w").shape == (4, 32)
    iq2 = np.zeros((1, 66), np.uint8)  # one IQ2_XXS block
    other = _write(tmp_path / "iq2.gguf", {"w": (iq2, GGMLQuantizationType.IQ2_XXS)})
    with pytest.raises(ValueError, match=r"tensor 'w' is of GGUF type 16.*reads F32"):
        GgufFile.open(other)
    (info,) = read_header(fine).tensors
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(fine.read_bytes()[: info.offset + q8.size - 1])  # its last byte missing
    with pytest.raises(ValueError, match=r"tensor 'w' ends past the end of the file"):
        GgufFile.open(cut)
