"""Typed replies keep the protocol JSON: the store's and the controller's, written and read back."""

from __future__ import annotations

import json
from dataclasses import asdict

import msgspec
import pytest

from stragglers.adapt.controller import (ADJUST_BS, KILL_RESTART, Actions, AdjustBatches,
                                         ControlConfig, Controller, ControllerState,
                                         KillRestart)
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.replies import (Joined, LeaseReply, Snapshot, Status, from_json,
                                      to_builtins)
from stragglers.adapt.shards import ShardStore
from stragglers.protocols import CONTROLLER_POLICIES, ControllerPolicy


def wire(reply: msgspec.Struct) -> object:
    """What the service sends for a reply (and what a client parses)."""
    return json.loads(json.dumps(to_builtins(reply), allow_nan=False))


def test_lease_replies_have_the_protocols_keys_and_read_back(tmp_path):
    now = [0.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0])
    store.create_dataset(DatasetConfig("d", 30, 10, lease_s=1.0))
    joined = store.join("d", "w")
    assert wire(joined) == {"fence": 1, "released": []}
    first = store.lease("d", "w", joined.fence, request_id="r1")
    sent = wire(first)
    assert list(sent) == ["status", "leases", "failed", "failed_total"]
    # a held lease has no "held" key (the wire never had one for it)
    assert sent["leases"] == [{"epoch": 0, "shard": 0, "offset": 0,
                               "indices": first.leases[0].indices, "size": 10}]
    assert from_json(sent, LeaseReply) == first
    now[0] = 2.0   # w's lease expired: w2's lease requeues shard 0 and takes it
    assert store.lease("d", "w2", store.join("d", "w2").fence).leases[0].shard == 0
    replay = wire(store.lease("d", "w", joined.fence, request_id="r1"))
    assert replay["leases"] == [{"epoch": 0, "shard": 0, "offset": 0, "indices": [],
                                 "size": 10, "held": False}]
    rejoined = store.join("d", "w2")
    assert wire(rejoined) == {"fence": 2, "released": [[0, 0]]}
    assert from_json(wire(rejoined), Joined) == rejoined
    store.close()


def test_status_has_the_protocols_keys_and_reads_back(tmp_path):
    store = ShardStore(tmp_path / "s.db")
    cfg = DatasetConfig("d", 30, 10)
    store.create_dataset(cfg)
    store.lease("d", "w", store.join("d", "w").fence)
    sent = wire(store.status("d"))
    assert list(sent) == ["dataset", "epochs_created", "epochs", "failed", "failed_total"]
    assert sent["dataset"] == asdict(cfg)
    assert sent["epochs"] == {"0": {"TODO": 2, "DOING": 1, "DONE": 0, "FAILED": 0}}
    assert from_json(sent, Status) == store.status("d")
    store.close()


def test_a_snapshot_reads_back_and_is_sent_as_the_same_json(tmp_path):
    store = ShardStore(tmp_path / "s.db")
    store.create_dataset(DatasetConfig("d", 30, 10, num_epochs=2))
    store.lease("d", "w", store.join("d", "w").fence)
    sent = store.snapshot("d")   # the JSON document GET .../snapshot answers
    snap = from_json(sent, Snapshot)
    assert snap.dataset == DatasetConfig("d", 30, 10, num_epochs=2) and snap.epochs_created == 1
    assert [row[:3] for row in snap.shards] == [(0, 0, "DOING"), (0, 1, "TODO"), (0, 2, "TODO")]
    assert wire(snap) == sent   # what ShardClient.restore sends back
    with pytest.raises(ValueError, match=r"Snapshot.*shards"):
        from_json({**sent, "shards": [[0, 0, "TODO", 0]]}, Snapshot)
    store.close()


def test_a_reply_of_another_shape_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"LeaseReply.*failed_total"):
        from_json({"status": "ok", "leases": [], "failed": []}, LeaseReply)
    with pytest.raises(ValueError, match="status"):
        from_json({"status": "maybe", "leases": [], "failed": [], "failed_total": 0}, LeaseReply)


def test_controller_state_and_actions_keep_their_json():
    ctl = Controller(ControlConfig("dd", 2, 64, window=2))
    for step in range(2, 6):
        ctl.observe(0, step, 0.32, 32)
        ctl.observe(1, step, 0.96, 32)
    state = wire(ctl.state())
    assert list(state) == ["config", "batch_sizes", "classes", "actions", "kills"]
    assert state["classes"]["1"]["class"] != "none" and set(state["classes"]["1"]) == {
        "ratio", "class", "per_sample_time", "windows"}
    action = state["actions"][0]
    assert list(action) == ["seq", "kind", "effective_step", "batch_sizes", "memory_cap",
                            "target", "reason"]
    assert action["kind"] == ADJUST_BS and sum(action["batch_sizes"]) == 64
    assert msgspec.convert(wire(ctl.actions_since(0)), Actions).actions == ctl.actions


def test_a_window_without_records_writes_null_not_nan():
    ctl = Controller(ControlConfig("bsp", 2, 64, window=1))
    ctl.monitor.warmup_steps = 0
    ctl.observe(0, 0, 0.1, 32)
    ctl.observe(1, 0, 0.1, 0)   # a rank with an empty batch has no per-sample time
    classes = wire(ctl.state())["classes"]
    assert classes["1"]["per_sample_time"] is None and classes["0"]["per_sample_time"] > 0


def test_policies_take_the_typed_state_and_match_the_protocol():
    ctl = Controller(ControlConfig("nd", 2, 64, window=2, total_steps=10_000,
                                   restart_cost_s=0.0, persistent_windows=1))
    for step in range(2, 4):
        ctl.observe(0, step, 0.32, 32)
        ctl.observe(1, step, 3.2, 32)
    state = ctl._view()
    assert isinstance(state, ControllerState)
    for name in ("bsp", "dd", "nd"):
        policy = CONTROLLER_POLICIES.get(name)()
        assert isinstance(policy, ControllerPolicy)
        proposals = policy.decide(state)
        assert all(isinstance(p, (AdjustBatches, KillRestart)) for p in proposals)
    # ND restarted the persistent straggler once (max_restarts=1); with that spent it re-splits
    assert [(a.kind, a.target) for a in ctl.actions] == [(KILL_RESTART, 1)]
    assert isinstance(CONTROLLER_POLICIES.get("nd")().decide(state)[0], AdjustBatches)
