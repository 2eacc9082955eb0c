"""The op type of a table of many row groups or files (a dictionary per chunk) is mapped once over
the chunks' unified dictionary: the codes are those of each chunk's own names."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from stragglers.errors import InputError
from stragglers.trace.columns import _dictionary_codes, optype_codes
from stragglers.trace.model import OPTYPE_CODES


def _chunk(names: list[str], indices: list[int | None]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(indices, pa.int32()),
                                          pa.array(names, pa.string()))


def test_chunks_with_their_own_dictionaries():
    col = pa.chunked_array([_chunk(["optimizer", "forward-compute"], [1, 0, 1]),
                            _chunk(["forward-compute", "backward-compute"], [1, 1, 0]),
                            _chunk(["backward-compute"], [])])
    want = [OPTYPE_CODES[n] for n in ("forward-compute", "optimizer", "forward-compute",
                                      "backward-compute", "backward-compute", "forward-compute")]
    codes = optype_codes(col, "t.parquet")
    assert codes.dtype == np.int8 and codes.tolist() == want
    # the same as each chunk mapped on its own
    one = [optype_codes(c, "t.parquet") for c in col.chunks]
    assert codes.tolist() == np.concatenate(one).tolist()


def test_an_unknown_name_in_a_later_chunk_is_named():
    col = pa.chunked_array([_chunk(["optimizer"], [0, 0]),
                            _chunk(["optimizer", "warp-drive"], [0, 1])])
    with pytest.raises(InputError, match=r"t\.parquet.*optype.*unknown op types \['warp-drive'\]"):
        optype_codes(col, "t.parquet")


def test_an_unused_unknown_name_is_no_error():
    col = pa.chunked_array([_chunk(["optimizer", "warp-drive"], [0]), _chunk(["optimizer"], [0])])
    assert optype_codes(col, "t").tolist() == [OPTYPE_CODES["optimizer"]] * 2


def test_nulls_in_any_chunk_are_counted():
    col = pa.chunked_array([_chunk(["optimizer"], [0, None]), _chunk(["optimizer"], [None, 0])])
    with pytest.raises(InputError, match=r"optype.*2 rows have no op type"):
        optype_codes(col, "t")


@pytest.mark.parametrize("indices", [[0, 5], [-1, 0]], ids=["past-the-end", "negative"])
def test_a_dictionary_index_outside_its_names_is_one_line(indices):
    # Parquet's reader checks neither the indices nor UTF-8: one damaged byte of a rank file
    # was 'internal error: IndexError' (a reviewer's fuzz)
    names = pa.array(["forward-compute", "backward-compute"])
    with pytest.raises(InputError, match="a dictionary index .* outside its 2 names"):
        _dictionary_codes(names, np.array(indices), "rank-00000.parquet")


def test_an_op_type_name_that_is_not_utf8_is_named_escaped():
    raw = pa.array([b"grads-reduce-scatte\xe3"], pa.binary())
    names = pa.Array.from_buffers(pa.string(), 1, raw.buffers())   # as a damaged file reads
    with pytest.raises(InputError, match=r"unknown op types .*scatte\\\\xe3"):
        _dictionary_codes(names, np.array([0]), "rank-00000.parquet")
