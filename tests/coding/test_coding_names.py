"""The coding base class is MatrixCode: the old exports GradientCode and Decoding (the names of
the interfaces in stragglers.protocols) still work, with a DeprecationWarning."""

import pytest

import stragglers.coding as coding
from stragglers import protocols


def test_the_old_names_warn_and_give_the_renamed_classes():
    with pytest.warns(DeprecationWarning, match="stragglers.coding.MatrixCode"):
        from stragglers.coding import GradientCode
    with pytest.warns(DeprecationWarning, match="stragglers.coding.DecodingVector"):
        assert coding.Decoding is coding.DecodingVector
    assert GradientCode is coding.MatrixCode
    assert "GradientCode" not in coding.__all__ and "GradientCode" not in dir(coding)


def test_a_matrix_code_and_its_decoding_implement_the_protocols():
    code = coding.make_code("cyclic-repetition", 4, 1)
    assert isinstance(code, coding.MatrixCode) and isinstance(code, protocols.GradientCode)
    assert isinstance(code.decode([0, 1, 2]), protocols.Decoding)
