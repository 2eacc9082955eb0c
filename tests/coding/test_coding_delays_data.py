"""Delays are deterministic and heavy-tailed; data parts are equal and deterministic."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import free_port

from stragglers.coding import make_code
from stragglers.coding.data import PartitionedData, load_digits_parts
from stragglers.coding.delays import DelaySampler, FixedDelays
from stragglers.coding.training import train_coded
from stragglers.errors import InputError, StragglersError


def test_delays_are_a_function_of_seed_step_worker():
    a, b = DelaySampler("pareto", 0.01, seed=3), DelaySampler("pareto", 0.01, seed=3)
    assert [a(t, w) for t in range(5) for w in range(4)] == [b(t, w) for t in range(5) for w in range(4)]
    assert a(0, 0) != DelaySampler("pareto", 0.01, seed=4)(0, 0)
    assert DelaySampler("none", 1.0)(1, 1) == 0.0
    assert FixedDelays({(2, 1): 0.5})(2, 1) == 0.5 and FixedDelays({})(0, 0) == 0.0


def test_pareto_delays_are_heavy_tailed():
    pareto = np.array([DelaySampler("pareto", 1.0, seed=0)(t, 0) for t in range(4000)])
    expo = np.array([DelaySampler("exponential", 1.0, seed=0)(t, 0) for t in range(4000)])
    # tail ratio p99.9 / median: ~ 100 for Lomax(1.5), ~ 10 for the exponential
    assert np.quantile(pareto, 0.999) / np.median(pareto) > 3 * np.quantile(expo, 0.999) / np.median(expo)


@pytest.mark.parametrize("kwargs,field", [({"dist": "cauchy"}, "dist"), ({"scale": -1}, "scale")])
def test_bad_delay_options(kwargs, field):
    with pytest.raises(InputError) as err:
        DelaySampler(**kwargs)
    assert err.value.field == field


@pytest.mark.slow
def test_digits_parts_are_equal_and_deterministic():
    parts = load_digits_parts(8, batch_size=32, seed=0)
    assert parts.X.shape == (8, 224, 64) and parts.part_size == 224
    x0, y0 = parts.batch(3, 5)
    x1, y1 = load_digits_parts(8, batch_size=32, seed=0).batch(3, 5)
    assert torch.equal(x0, x1) and torch.equal(y0, y1) and x0.shape == (32, 64)
    assert not torch.equal(parts.batch(3, 6)[0], x0)
    with pytest.raises(InputError):
        PartitionedData(torch.zeros(3, 2), torch.zeros(3), 4)


def test_train_coded_checks_world_size():
    with pytest.raises(StragglersError, match="torchrun"):
        train_coded(None, None, None, None, make_code("frc", 4, 1), 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(InputError, match="5 ranks"):
            train_coded(None, None, None, None, make_code("frc", 4, 1), 1)
    finally:
        dist.destroy_process_group()
