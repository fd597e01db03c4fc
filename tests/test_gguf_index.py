"""GGUFIndex reads what gguf.GGUFReader reads (tensors, their bytes, metadata), fast."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from kiln.models.gguf_index import GGUFIndex
from kiln.models.model_source import default_gguf_path


@pytest.fixture(scope="module")
def both():
    path = default_gguf_path()
    return GGUFIndex(path), gguf.GGUFReader(path)


def test_tensors_match_gguf_reader(both):
    index, reader = both
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.n_bytes == theirs.n_bytes
        assert list(ours.shape) == list(theirs.shape)
        assert ours.data.shape == theirs.data.shape and ours.data.dtype == theirs.data.dtype
        assert np.array_equal(np.asarray(ours.data), np.asarray(theirs.data)), ours.name
    kinds = {t.tensor_type.name for t in index.tensors}
    assert {"F32", "Q4_1", "Q8_0"} <= kinds  # float, and both block families, covered


def test_metadata_matches_gguf_reader(both):
    index, reader = both
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(index.fields)
    for key in keys:
        ours, theirs = index.get_field(key).contents(), reader.fields[key].contents()
        assert ours == pytest.approx(theirs) if isinstance(theirs, float) else ours == theirs
    assert len(index.get_field("tokenizer.ggml.tokens").contents()) == 49152


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        GGUFIndex(path)
