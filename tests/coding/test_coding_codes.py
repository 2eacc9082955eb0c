"""Gradient codes: the spec's test vectors, exhaustive exact decoding for n <= 12, properties."""

import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stragglers.coding import (CyclicMDSCode, CyclicRepetitionCode, FractionalRepetitionCode,
                               MatrixCode, make_code)
from stragglers.coding.matrix_code import least_squares_decoding
from stragglers.errors import InputError

PHI = (1 + 5 ** 0.5) / 2


def test_spec_vector_n3_s1_decoders():
    B = np.array([[0.5, 1, 0], [0, 1, -1], [0.5, 0, 1]])
    A = np.array([[0, 1, 2], [1, 0, 1], [2, -1, 0]])
    code = MatrixCode(3, 1, B)
    for k in range(3):
        survivors = [i for i in range(3) if i != k]
        np.testing.assert_allclose(code.decode(survivors).coefficients, A[k], atol=1e-12)
    np.testing.assert_allclose(A @ B, np.ones((3, 3)))


@pytest.mark.parametrize("n,s,c", [
    (4, 1, [1, 1]), (5, 2, [1, PHI, 1]), (6, 3, [1, 2, 2, 1]),
    (7, 2, [1, 2 * np.cos(np.pi / 7), 1]), (8, 3, [1, 1 + 2 ** 0.5, 1 + 2 ** 0.5, 1]),
])
def test_spec_real_generators(n, s, c):
    code = CyclicMDSCode(n, s, "real")
    np.testing.assert_allclose(code.generator, c, atol=1e-12)
    for i in range(n):  # row i is the cyclic shift x^i g(x) on the window i..i+s
        assert code.parts(i) == tuple(sorted((i + k) % n for k in range(s + 1)))


@pytest.mark.parametrize("n,s,K,a", [
    (4, 1, [0, 1, 2], [1, 0, 1, 0]),
    (5, 2, [0, 1, 2], [1, 1 - PHI, 1, 0, 0]),
    (6, 3, [0, 1, 2], [1, -1, 1, 0, 0, 0]),
    (6, 3, [0, 2, 4], [1 / 3, 0, 1 / 3, 0, 1 / 3, 0]),
    (8, 3, [0, 1, 2, 3, 4], [1, -2 ** 0.5, 2, -2 ** 0.5, 1, 0, 0, 0]),
])
def test_spec_real_decoding_vectors(n, s, K, a):
    d = CyclicMDSCode(n, s, "real").decode(K)
    assert d.method == "lstsq"  # the accurate decoder is the default
    np.testing.assert_allclose(d.coefficients, a, atol=1e-12)
    closed = CyclicMDSCode(n, s, "real", decoder="closed-form").decode(K)
    assert closed.method == "closed-form"
    np.testing.assert_allclose(closed.coefficients, a, atol=1e-12)


def _exact_codes(n, s):
    yield CyclicRepetitionCode(n, s, seed=0)
    yield CyclicMDSCode(n, s, "complex")
    if (n - s) % 2:
        yield CyclicMDSCode(n, s, "real")
    if n % (s + 1) == 0:
        yield FractionalRepetitionCode(n, s)


@pytest.mark.slow
def test_every_survivor_set_decodes_exactly_up_to_n12():
    checked = 0
    for n in range(2, 13):
        for s in range(1, n):
            for code in _exact_codes(n, s):
                for K in itertools.combinations(range(n), n - s):
                    d = code.decode(K)
                    assert d.residual <= 1e-9, (code, K, d.residual)
                    assert np.all(d.coefficients[np.setdiff1d(range(n), K)] == 0)
                    checked += 1
    assert checked > 20000


@st.composite
def n_s_survivors(draw, max_n=40):
    n = draw(st.integers(2, max_n))
    s = draw(st.integers(1, min(n - 1, 6)))
    K = draw(st.permutations(range(n)))[: n - s]
    return n, s, list(K)


@settings(max_examples=60, deadline=None)
@given(n_s_survivors(), st.sampled_from(["real", "complex"]))
def test_mds_closed_form_matches_least_squares(nsk, field):
    n, s, K = nsk
    if field == "real" and (n - s) % 2 == 0:
        s -= 1  # n − s odd
        K = K + [k for k in range(n) if k not in K][:1]
    if s == 0:
        return
    code = CyclicMDSCode(n, s, field, decoder="closed-form")
    d = code.decode(K)
    ls = least_squares_decoding(code, K)
    tol = 1e-13 * max(1.0, d.condition_number) * n
    assert d.residual <= tol
    np.testing.assert_allclose(d.coefficients, ls.coefficients, atol=tol)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(n_s_survivors(), st.sampled_from(["cyclic-repetition", "cyclic-mds", "frc"]))
def test_decoded_combination_is_the_gradient_sum(nsk, scheme):
    n, s, K = nsk
    if scheme == "frc" and n % (s + 1):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = make_code(scheme, n, s, seed=n, on_unstable="ignore")
    G = np.random.default_rng(n * 31 + s).standard_normal((n, 5))
    messages = (code.B @ G)[K]  # what the survivors send
    d = code.decode(K)
    tol = 1e-12 * max(1.0, d.condition_number) * n
    np.testing.assert_allclose(d.combine(messages), G.sum(axis=0), atol=tol * np.abs(G).sum())


def test_more_survivors_than_needed_uses_all_of_them():
    code = CyclicMDSCode(9, 2, "real")
    d = code.decode(range(9))
    assert d.method == "lstsq" and d.residual < 1e-12


@pytest.mark.parametrize("call,field", [
    (lambda: CyclicMDSCode(8, 2, "real"), "s"),
    (lambda: FractionalRepetitionCode(8, 2), "s"),
    (lambda: CyclicMDSCode(5, 5), "s"),
    (lambda: make_code("nope", 4, 1), "scheme"),
    (lambda: CyclicMDSCode(5, 2).decode([0, 1]), "survivors"),
    (lambda: CyclicMDSCode(5, 2).decode([0, 1, 1]), "survivors"),
    (lambda: CyclicMDSCode(5, 2).decode([0, 1, 7]), "survivors"),
    (lambda: CyclicMDSCode(5, 2).decode([0, 1, 2.5]), "survivors"),
    (lambda: CyclicMDSCode(5, 2).decode([0, 1, "2"]), "survivors"),
    (lambda: CyclicMDSCode(5, 2).parts(1.5), "worker"),
    (lambda: CyclicMDSCode(5, 2).decode([0, 1, 2]).combine(np.ones((2, 4))), "messages"),
    (lambda: CyclicMDSCode(5, 2, decoder="magic"), "decoder"),
    (lambda: make_code("frc", 6, 2, d=3), "d"),
    (lambda: make_code("cyclic-mds", 7, 2, d=3), "d"),
    (lambda: make_code("frc", 6, 2, decoder="fixed"), "decoder"),
    (lambda: make_code("wait-for-all", 6, 2), "s"),
    # refused before a dense n × n matrix is allocated (n = 100,000 asked for 75 GB)
    (lambda: make_code("cyclic-mds", 100_000, 3), "n"),
    (lambda: make_code("expander", 2049, 2), "n"),
    (lambda: make_code("cyclic-mds", 9, 2, tolerance=float("nan")), "tolerance"),
    (lambda: make_code("cyclic-mds", 9, 2, tolerance=-1.0), "tolerance"),
])
def test_bad_parameters_are_input_errors(call, field):
    with pytest.raises(InputError) as err:
        call()
    assert err.value.field == field


def test_real_mds_with_even_n_minus_s_falls_back_and_says_so():
    with pytest.warns(RuntimeWarning, match="complex cyclic MDS"):
        assert make_code("cyclic-mds", 8, 2).name == "cyclic-mds-complex"
    with pytest.warns(RuntimeWarning, match="fractional repetition"):
        assert make_code("cyclic-mds-real", 6, 2).name == "frc"


def test_frc_uses_first_arrival_of_each_group():
    code = FractionalRepetitionCode(6, 2)
    d = code.decode([5, 1, 3, 4])
    assert d.method == "group-sum"
    np.testing.assert_array_equal(d.coefficients, [0, 1, 0, 0, 0, 1])


@pytest.mark.parametrize("n,s", [(7, 2), (10, 3), (16, 5)])
def test_complex_closed_form_is_the_spec_lagrange_formula(n, s):
    code = CyclicMDSCode(n, s, "complex")
    K = list(np.random.default_rng(n).permutation(n)[: n - s])
    z = np.exp(2j * np.pi * np.array(K) / n)
    diff = z[:, None] - z[None, :]
    np.fill_diagonal(diff, 1.0)
    spec = n / code.generator.sum() * z ** (n - s - 1) / diff.prod(axis=1)
    np.testing.assert_allclose(code.decode(K).coefficients[K], spec, atol=1e-10)
    closed = CyclicMDSCode(n, s, "complex", decoder="closed-form")
    np.testing.assert_allclose(closed.decode(K).coefficients[K], spec, atol=1e-10)
