"""The small files a user names (the monitor's --config, NDTimeline's metadata YAML): a FIFO, a
device, a directory, a file too large or nested too deep is one line naming the file, never a
blocked start, a filled memory or a RecursionError."""

from __future__ import annotations

import os

import pytest

from stragglers.errors import InputError
from stragglers.monitor.settings import load_config_file
from stragglers.smallfiles import load_yaml_file, read_small_file
from stragglers.trace.ndtimeline import read_meta_yaml


def _fifo(tmp_path):
    path = tmp_path / "fifo.yaml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make, words", [
    (_fifo, "not a regular file"),
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: tmp / "missing.yaml", "no such file"),
])
def test_what_is_no_regular_file_is_one_line(tmp_path, make, words):
    path = make(tmp_path)
    with pytest.raises(InputError) as err:
        read_small_file(path, "a test file")
    assert words in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_device_or_a_large_file_is_read_no_further_than_the_bound(tmp_path):
    with pytest.raises(InputError, match="not a regular file"):
        read_small_file("/dev/zero", "a test file")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"a: 1\n" * 1000)
    with pytest.raises(InputError, match="more than 100 bytes"):
        read_small_file(big, "a test file", max_bytes=100)
    assert read_small_file(big, "a test file", max_bytes=5000) == big.read_bytes()


def test_yaml_nested_too_deep_or_not_utf8_is_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("webhooks: " + "[" * 20000 + "]" * 20000)
    with pytest.raises(InputError, match="nested too deep"):
        load_yaml_file(deep, "a test file")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(InputError, match="not UTF-8"):
        load_yaml_file(latin, "a test file")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_yaml_file(empty, "a test file") is None


def test_the_monitor_config_and_ndtimeline_metadata_read_through_it(tmp_path):
    fifo = _fifo(tmp_path)
    for read in (load_config_file, read_meta_yaml):
        with pytest.raises(InputError, match="not a regular file"):
            read(fifo)
    with pytest.raises(InputError, match="metadata file not found"):
        read_meta_yaml(tmp_path / "meta-x.yaml")
    good = tmp_path / "monitor.yaml"
    good.write_text("external_url: http://127.0.0.1:8150\n")
    assert load_config_file(good) == {"external_url": "http://127.0.0.1:8150"}


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    # nine levels of ten aliases: 526 bytes that expand to 10⁹ nodes (a "billion laughs")
    lines = ["a0: &a0 [x]"] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]"
                               for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\nreceiver: *a9\n")
    with pytest.raises(InputError, match="alias"):
        load_yaml_file(bomb, "a test file")
    with pytest.raises(InputError, match="alias"):
        load_config_file(bomb)
