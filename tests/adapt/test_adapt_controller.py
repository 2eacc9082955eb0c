"""SpeedMonitor windows, straggler classes and DD / ND controller decisions on synthetic records."""

from __future__ import annotations

import pytest

from stragglers.adapt.controller import ADJUST_BS, KILL_RESTART, ControlConfig, Controller
from stragglers.adapt.monitor import DETERMINISTIC, NONE, PERSISTENT, TRANSIENT, SpeedMonitor
from stragglers.errors import InputError


def feed(ctl, steps, per_sample, batches=None, start=0, devices=None):
    """Every rank reports `steps` steps; per-sample time per rank; returns the actions."""
    out = []
    for s in range(start, start + steps):
        for r, t in enumerate(per_sample):
            b = (batches or ctl.batch_sizes)[r]
            out += ctl.observe(r, s, t * b, b, (devices or [""] * len(per_sample))[r])
    return out


def test_monitor_classes_transient_then_persistent_and_deterministic():
    m = SpeedMonitor(3, window=2, theta=1.3, persistent_windows=3, warmup_steps=0)
    classes = []
    for w in range(4):
        for s in range(2 * w, 2 * w + 2):
            for r in range(3):
                m.record(r, s, 0.1 * (2.0 if r == 2 else 1.0) * 10, 10)
        assert m.window_ready()
        classes.append(m.evaluate()[2].category)
    assert classes == [TRANSIENT, TRANSIENT, PERSISTENT, PERSISTENT]
    d = SpeedMonitor(3, window=1, persistent_windows=1, warmup_steps=0)
    for r, dev in enumerate(["a100", "a100", "v100"]):
        d.record(r, 0, 0.3 if r == 2 else 0.1, 1, dev)
    out = d.evaluate()
    assert out[2].category == DETERMINISTIC and out[0].category == NONE
    assert out[2].ratio == pytest.approx(3.0)


def test_monitor_normalises_by_batch_so_resized_batches_do_not_hide_a_straggler():
    m = SpeedMonitor(2, window=1, persistent_windows=1, warmup_steps=0)
    m.record(0, 0, 0.3, 30)  # same BPT, but 3x fewer samples on rank 1
    m.record(1, 0, 0.3, 10)
    assert m.evaluate()[1].ratio == pytest.approx(1.5)  # 3x over a median of 2x


def test_dd_splits_by_measured_throughput_keeping_the_global_batch():
    ctl = Controller(ControlConfig("dd", 4, 128, memory_cap=16, window=3))
    actions = feed(ctl, 6, [0.01, 0.01, 0.01, 0.03])
    assert actions and actions[0].kind == ADJUST_BS
    sizes = actions[0].batch_sizes
    assert sum(sizes) == 128 and sizes[3] == pytest.approx(128 / 10, abs=1)
    assert actions[0].effective_step > 5 and actions[0].memory_cap == 16
    # A stable split is not re-issued.
    assert feed(ctl, 6, [0.01, 0.01, 0.01, 0.03], start=6) == []


def test_nd_adjusts_for_a_transient_and_kills_a_persistent_straggler():
    cfg = ControlConfig("nd", 4, 128, total_steps=1000, restart_cost_s=5.0, window=2,
                        persistent_windows=3)
    ctl = Controller(cfg)
    first = feed(ctl, 4, [0.01, 0.01, 0.01, 0.03])  # warm-up + one window: transient
    assert [a.kind for a in first] == [ADJUST_BS]
    later = feed(ctl, 6, [0.01, 0.01, 0.01, 0.03], start=4)
    kills = [a for a in later if a.kind == KILL_RESTART]
    assert len(kills) == 1 and kills[0].target == 3
    assert "gain" in kills[0].reason
    # Not worth it when few steps remain: keep adjusting instead.
    short = Controller(ControlConfig("nd", 4, 128, total_steps=12, restart_cost_s=5.0, window=2))
    acts = feed(short, 12, [0.01, 0.01, 0.01, 0.03])
    assert all(a.kind == ADJUST_BS for a in acts)


def test_nd_returns_to_equal_batches_when_the_straggler_recovers():
    ctl = Controller(ControlConfig("nd", 2, 64, window=2, total_steps=0))
    feed(ctl, 4, [0.01, 0.03])
    assert ctl.batch_sizes != [32, 32]
    acts = feed(ctl, 4, [0.01, 0.01], start=4)
    assert acts[-1].batch_sizes == [32, 32]


def test_bsp_only_observes():
    ctl = Controller(ControlConfig("bsp", 2, 64, window=2))
    assert feed(ctl, 10, [0.01, 0.05]) == []
    assert ctl.last_classes[1].category != NONE


def test_bad_control_config():
    with pytest.raises(InputError, match="policy"):
        Controller(ControlConfig("asp", 2, 64))
    with pytest.raises(InputError, match="global_batch"):
        Controller(ControlConfig("dd", 8, 4))


def test_nd_never_spends_a_restart_on_a_deterministic_straggler():
    """Rank 3 is slow because its device type is slower: a relaunch would not help (DD's case)."""
    cfg = ControlConfig("nd", 4, 128, total_steps=1000, restart_cost_s=0.01, window=2,
                        persistent_windows=2)
    ctl = Controller(cfg)
    devices = ["a100", "a100", "a100", "v100"]
    acts = feed(ctl, 20, [0.01, 0.01, 0.01, 0.03], devices=devices)
    assert ctl.last_classes[3].category == DETERMINISTIC
    assert acts and all(a.kind == ADJUST_BS for a in acts)
    assert acts[-1].batch_sizes[3] < 128 / 4 / 2  # work moved away from it
    # The same slowness on the common device type is persistent, and is restarted.
    same = Controller(cfg)
    kills = [a for a in feed(same, 20, [0.01, 0.01, 0.01, 0.03], devices=["a100"] * 4)
             if a.kind == KILL_RESTART]
    assert [a.target for a in kills] == [3]


def test_policies_are_registered_and_configs_are_validated():
    from stragglers.protocols import CONTROLLER_POLICIES

    assert {"bsp", "dd", "nd"} <= set(CONTROLLER_POLICIES.names())
    for name in ("bsp", "dd", "nd"):
        assert CONTROLLER_POLICIES.get(name).name == name
    with pytest.raises(InputError, match="theta"):
        ControlConfig("dd", 2, 64, theta=float("nan"))
    with pytest.raises(InputError, match="memory_cap"):
        ControlConfig("dd", 2, 64, memory_cap=0)
    with pytest.raises(InputError, match="unknown"):
        ControlConfig.from_mapping({"policy": "dd", "world_size": 2, "global_batch": 4, "x": 1})


def test_a_repeated_report_is_not_counted_twice():
    m = SpeedMonitor(1, window=3, warmup_steps=0)
    for step in (0, 1, 1, 1, 2):
        m.record(0, step, 0.1, 10)
    assert len(m.workers[0].records) == 3


def test_the_old_export_monitor_warns_and_gives_the_speed_monitor():
    import stragglers.adapt as adapt

    with pytest.warns(DeprecationWarning, match="stragglers.adapt.SpeedMonitor"):
        assert adapt.Monitor is SpeedMonitor
    assert "Monitor" not in adapt.__all__
