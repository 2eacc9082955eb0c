"""A token file owned by another user than the one running the service is refused (both
services' `--token-file`, and through a link of ours), one line naming the file and its owner,
before anything is started (serving.read_token_file)."""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="needs root to give the file to another user")


def _planted(tmp_path):
    """A token file of mode 0600 owned by uid 65534 (another user: whoever planted it)."""
    planted = tmp_path / "planted.token"
    planted.write_text("planted-by-another-user-0123456789\n")
    planted.chmod(0o600)
    os.chown(planted, 65534, 65534)
    return planted


@pytest.mark.parametrize("service", ["adapt", "monitor"])
@pytest.mark.parametrize("linked", [False, True])
def test_a_token_file_of_another_user_stops_the_start_with_one_line(
        tmp_path, monkeypatch, capsys, service, linked):
    from stragglers.cli import main

    planted = _planted(tmp_path)
    given = planted
    if linked:   # (a link of ours to it: the file opened is judged, not the name)
        given = tmp_path / "mine.token"
        given.symlink_to(planted)
    db = tmp_path / "service.db"
    monkeypatch.setattr(sys, "argv", ["stragglers", service, "serve", "--db", str(db),
                                      "--port", "0", "--token-file", str(given)])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2, err
    assert len(err.splitlines()) == 1, err
    assert str(given) in err and "uid 65534" in err and f"uid {os.geteuid()}" in err, err
    assert not db.exists()   # (refused before the store was opened)


def test_a_token_file_given_to_its_reader_is_read(tmp_path):
    from stragglers.serving import read_token_file

    planted = _planted(tmp_path)
    os.chown(planted, os.geteuid(), os.getegid())   # (the fix the error names)
    assert read_token_file(planted) == "planted-by-another-user-0123456789"
