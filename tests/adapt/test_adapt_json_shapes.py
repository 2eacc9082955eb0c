"""The shard store's JSON TypedDicts name the fields of the types they are the JSON of, in order."""

from __future__ import annotations

import dataclasses
import re
import typing

import msgspec

from stragglers.adapt.checkpoint import CheckpointFile, JobCheckpoint
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.replies import DatasetJson, Snapshot, SnapshotJson
from stragglers.adapt.shards import ShardStore
from stragglers.adapt.stored import VALID_SHARD_SQL, ShardParams, shard_params


def test_each_json_typeddict_lists_its_types_fields_in_order():
    assert list(DatasetJson.__annotations__) == [f.name for f in dataclasses.fields(DatasetConfig)]
    assert list(SnapshotJson.__annotations__) == list(Snapshot.__struct_fields__)
    assert list(CheckpointFile.__annotations__) == [
        f.name for f in dataclasses.fields(JobCheckpoint)]


def test_shard_params_are_the_named_parameters_of_the_shard_check():
    named = set(re.findall(r":(\w+)", VALID_SHARD_SQL))
    assert set(typing.get_type_hints(ShardParams)) == named
    assert set(shard_params(DatasetConfig("d", 30, 10), 1)) == named


def test_a_snapshot_has_the_keys_its_typeddict_declares(tmp_path):
    store = ShardStore(tmp_path / "s.db")
    store.create_dataset(DatasetConfig("d", 30, 10))
    snap = store.snapshot("d")
    assert list(snap) == list(SnapshotJson.__annotations__)
    assert list(snap["dataset"]) == list(DatasetJson.__annotations__)
    assert msgspec.convert(snap, Snapshot).dataset == DatasetConfig("d", 30, 10)
    store.close()
