"""Expander codes (bound, λ, decoders) and the numerical-stability guard."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stragglers.coding import (CyclicMDSCode, ExpanderCode, UnstableCodeError, check_stability,
                               ignore_stragglers, make_code, random_regular_graph,
                               stability_report)
from stragglers.errors import InputError


@pytest.mark.parametrize("n,d", [(10, 3), (50, 3), (20, 4), (9, 2)])
def test_random_regular_graph_is_simple_regular_connected(n, d):
    A = random_regular_graph(n, d, seed=1)
    assert np.all(A == A.T) and np.all(np.diag(A) == 0) and set(np.unique(A)) <= {0, 1}
    assert np.all(A.sum(axis=1) == d)
    ev = np.sort(np.abs(np.linalg.eigvalsh(A)))
    assert ev[-1] == pytest.approx(d) and ev[-2] < d  # connected


def test_odd_degree_sum_is_an_input_error():
    with pytest.raises(InputError):
        random_regular_graph(9, 3)


def test_spec_numbers_n50_s10_d3():
    code = ExpanderCode(50, 10, 3, seed=0, decoder="fixed")
    assert 2 * np.sqrt(2) - 0.3 < code.lam < 3  # near-Ramanujan
    assert code.error_bound() < code.ignore_stragglers_error() == pytest.approx(3.5355, abs=1e-4)
    rng = np.random.default_rng(0)
    fixed, optimal = [], []
    for _ in range(200):
        K = sorted(rng.choice(50, 40, replace=False))
        fixed.append(code.decode_fixed(K).residual)
        optimal.append(code.decode_optimal(K).residual)
    assert max(fixed) <= code.error_bound()
    assert np.mean(optimal) < 1.4 and np.all(np.array(optimal) <= np.array(fixed) + 1e-12)
    ig = ignore_stragglers(50, 10)
    assert ig.decode(range(40)).residual == pytest.approx(ig.error_bound())


@settings(max_examples=40, deadline=None)
@given(st.integers(6, 40), st.integers(2, 5), st.integers(1, 8), st.randoms(use_true_random=False))
def test_expander_bound_holds_for_random_survivors(n, d, s, rnd):
    if d >= n or (n * d) % 2 or s >= n:
        return
    code = ExpanderCode(n, s, d, seed=rnd.randrange(1000))
    K = rnd.sample(range(n), n - s)
    fixed = code.decode_fixed(K).residual
    assert fixed <= code.error_bound() + 1e-9
    assert code.decode_optimal(K).residual <= fixed + 1e-9
    assert code.lower_bound() <= code.error_bound() + 1e-9


def test_guard_fires_for_n50_s11_float32():
    with pytest.raises(UnstableCodeError, match="frc|expander"):
        make_code("cyclic-mds", 50, 11, dtype="float32")
    code = CyclicMDSCode(50, 11, "real")
    with pytest.warns(RuntimeWarning, match="UNSTABLE"):
        report = check_stability(code, "float32", on_unstable="warn")
    assert report.worst_condition == pytest.approx(1.0e9, rel=0.1)
    assert not report.stable


@pytest.mark.slow
def test_guard_matches_spec_condition_numbers_and_passes_stable_codes():
    for n, s, kappa in [(12, 3, 76), (20, 5, 3.0e3), (30, 9, 9.7e5)]:
        assert stability_report(CyclicMDSCode(n, s, "real")).worst_condition == \
            pytest.approx(kappa, rel=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_code("cyclic-mds", 12, 3, dtype="float32")  # κ 76: fine
        make_code("cyclic-mds", 30, 9, dtype="float64")  # κ 1e6 · 1.1e-16: fine in float64
        make_code("frc", 48, 11, dtype="float32")
    # κ 1e9 in float64 is not certified by the analytic bound over all C(50, 11) sets: refused
    with pytest.raises(UnstableCodeError, match="analytic"):
        make_code("cyclic-mds", 50, 11, dtype="float64")


def test_guard_error_estimate_is_honest_for_float32_messages():
    # the predicted worst relative error must not underestimate the real one
    code = CyclicMDSCode(30, 9, "real")
    G = np.random.default_rng(0).standard_normal((30, 200))
    K = list(range(21))  # contiguous stragglers: the worst case
    messages = (code.B @ G)[K].astype(np.float32)
    got = code.decode(K).combine(messages)
    rel = np.linalg.norm(got - G.sum(0)) / np.linalg.norm(G.sum(0))
    report = stability_report(code, "float32")
    assert 1e-4 < rel <= report.worst_relative_error
