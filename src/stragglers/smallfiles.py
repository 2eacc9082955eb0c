"""Reading the small files a user names (a config or metadata file): opened without blocking
and only when regular, read up to a bound, YAML parsed with its nesting guarded. A FIFO named
as a config file would block a service's start for good, /dev/zero would fill the memory, and
20,000 nested lists overflow the YAML parser's recursion: each is one line naming the file."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from stragglers.errors import InputError

MAX_TEXT_FILE_BYTES = 1 << 20   # a config or metadata file is a few kB


def read_small_file(path: Path | str, expected: str, max_bytes: int = MAX_TEXT_FILE_BYTES,
                    missing: str | None = None,
                    check: Callable[[os.stat_result], str | None] | None = None) -> bytes:
    """The bytes of the regular file `path` (at most `max_bytes`); InputError naming it and
    `expected` (what it should be) when it is missing (`missing`: the words then), not a
    regular file, or larger, or where `check` finds a problem in the status of the very file
    opened (its words; before a byte is read: a token file that others may read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise InputError(path, None, missing or f"no such file (expected {expected})") from None
    except OSError as exc:
        raise InputError(path, None, f"cannot be read ({exc.strerror}; expected {expected})"
                         ) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(path, None, f"is a directory; expected {expected}")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(path, None, f"not a regular file; expected {expected}")
        problem = check(st) if check is not None else None
        if problem is not None:
            raise InputError(path, None, problem)
        data = b""
        while len(data) <= max_bytes:   # a file growing while read is bounded too
            chunk = os.read(fd, max_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise InputError(path, None, f"cannot be read ({exc.strerror}; expected {expected})"
                         ) from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise InputError(path, None, f"more than {max_bytes} bytes; expected {expected}")
    return data


def load_yaml_file(path: Path | str, expected: str, max_bytes: int = MAX_TEXT_FILE_BYTES,
                   missing: str | None = None) -> object:
    """The YAML document of a small file (None when empty); InputError naming the file when it
    cannot be read (read_small_file), is not UTF-8 or not YAML, or nests too deep to parse."""
    import yaml

    text = _text(path, expected, max_bytes, missing)
    try:
        loader = _no_alias_loader()
        return _nested(path, expected, lambda: yaml.load(text, Loader=loader))  # noqa: S506
    except yaml.YAMLError as exc:
        raise InputError(path, None, f"not valid YAML ({str(exc).splitlines()[0]})") from None


def load_json_file(path: Path | str, expected: str, max_bytes: int = MAX_TEXT_FILE_BYTES,
                   missing: str | None = None) -> object:
    """The JSON document of a small file; InputError naming the file when it cannot be read
    (read_small_file), is not UTF-8 or not JSON, or nests too deep to parse."""
    import json

    text = _text(path, expected, max_bytes, missing)
    try:
        return _nested(path, expected, lambda: json.loads(text))
    except json.JSONDecodeError as exc:
        raise InputError(path, None, f"not valid JSON ({exc}); expected {expected}") from None


def _text(path: Path | str, expected: str, max_bytes: int, missing: str | None) -> str:
    """A small file's text (read_small_file), InputError naming it unless UTF-8."""
    data = read_small_file(path, expected, max_bytes, missing)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(path, None, f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                         f"offset {exc.start}); expected {expected}") from None


def _nested(path: Path | str, expected: str, parse: Callable[[], object]) -> object:
    """parse(), InputError naming the file where the document nests too deep for the parser."""
    try:
        return parse()
    except RecursionError:
        raise InputError(path, None, f"nested too deep to read; expected {expected}") from None


def _no_alias_loader():
    """yaml's SafeLoader refusing aliases (`*name`): 526 bytes of aliases nine deep expand to
    10⁹ nodes (a "billion laughs"); a config or metadata file never needs one."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(
                    None, None, f"an alias (*name) at line {mark.line + 1}: not accepted", mark)
            return super().compose_node(parent, index)

    return NoAliases


def write_report_file(path: Path | str, text: str) -> None:
    """Write a report (JSON, HTML) whole or not at all: into a temporary file beside it, then
    renamed over it. An OSError names the path: a full disk's write() names no file, and the
    CLI took ENOSPC for a bug in stragglers (internal error), leaving half a report."""
    path = Path(path)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with open(part, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(part, path)
    except OSError as exc:
        try:
            part.unlink()
        except OSError:
            pass
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
