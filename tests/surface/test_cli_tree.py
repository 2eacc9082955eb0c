"""The `stragglers` command tree: every command's --help works, old names still run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer.main

from stragglers.cli import app


def _walk(command, path: tuple[str, ...] = ()):
    # by its sub-commands, not isinstance(click.Group): typer builds on its own copy of click,
    # so the check matched only the root and every sub-command went untested
    yield path, command
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from _walk(sub, path + (name,))


COMMANDS = list(_walk(typer.main.get_command(app)))


DEPRECATED = sorted(name for path, c in COMMANDS if getattr(c, "deprecated", False)
                    for name in path[-1:])


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "root")
def test_help_of_every_command(path):
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", *path, "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})  # one line per help text
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Usage" in proc.stdout
    if not any(name in DEPRECATED for name in path):
        # a current command's help sends the reader to current commands only
        cited = [old for old in DEPRECATED if re.search(rf"(?<![\w-]){old}(?![\w-])", proc.stdout)]
        assert not cited, cited


def test_every_command_has_a_help_line():
    missing = [" ".join(p) for p, c in COMMANDS if p and not (c.help or c.short_help)]
    assert not missing


def test_deprecated_aliases_are_hidden_and_say_so():
    for path, command in COMMANDS:
        if getattr(command, "deprecated", False):
            assert command.hidden, f"{' '.join(path)} is deprecated but listed"
            assert "use `stragglers" in (command.help or "").lower() or \
                "use 'stragglers" in (command.help or "").lower(), " ".join(path)


@pytest.mark.slow
def test_version_and_exit_codes():
    from stragglers import __version__

    out = subprocess.run([sys.executable, "-m", "stragglers.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"stragglers {__version__}"
    bad = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", "/nonexistent/run"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "/nonexistent/run" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_analyze_settings_come_from_the_diagnosis_config(tmp_path):
    import json

    import stragglers as st
    from stragglers.trace.runformat import write_run

    write_run(tmp_path / "run", st.synth(dp=2, pp=2, microbatches=4, steps=6, seed=1))
    cli = [sys.executable, "-m", "stragglers.cli", "analyze", str(tmp_path / "run"), "-q"]
    ok = subprocess.run(cli + ["--set", "worker_min_excess=0.5", "--json", str(tmp_path / "r.json")],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "r.json").read_text())["diagnosis_config"]["worker_min_excess"] == 0.5
    for bad, field in (("bogus=1", "bogus"), ("worker_min_excess=abc", "worker_min_excess"),
                       ("worker_min_excess=-1", "worker_min_excess")):
        proc = subprocess.run(cli + ["--set", bad], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and field in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_file_names_with_brackets_are_printed_as_given_not_read_as_markup(tmp_path):
    # Paths and job names reach the console in messages, progress lines and tables; rich would
    # read "[/x]" in them as a closing markup tag (MarkupError: "internal error", exit 4) and
    # "[b]" as a style (dropped from the message).
    from stragglers.trace.synth import generate
    from stragglers.trace.runformat import write_run

    run = tmp_path / "run[/x][b]"
    write_run(run, generate(dp=2, pp=2, microbatches=2, steps=4, seed=0))
    cli = [sys.executable, "-m", "stragglers.cli"]
    missing = subprocess.run(cli + ["analyze", str(tmp_path / "gone[/bold][b]")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "gone[/bold][b]" in missing.stderr, missing.stderr
    html, js = tmp_path / "out[/y].html", tmp_path / "out[b].json"
    ok = subprocess.run(cli + ["analyze", str(run), "--html", str(html), "--json", str(js)],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert str(html.resolve()) in ok.stdout.replace("\n", "") and html.exists() and js.exists()
    advised = subprocess.run(cli + ["advise", str(run)], capture_output=True, text=True,
                             timeout=300)
    assert advised.returncode == 0, advised.stderr[-2000:]


@pytest.mark.slow
def test_an_output_path_that_cannot_be_written_is_one_line_exit_2(tmp_path):
    # (it was "internal error: FileNotFoundError ... this is a bug", exit 4)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cli = [sys.executable, "-m", "stragglers.cli"]
    for args, named in ((["synth", str(blocker / "run")], str(blocker / "run")),
                        (["synth", "/proc/no/such/dir"], "/proc/no")):  # (the failing part)
        r = subprocess.run(cli + args, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.strip().startswith(f"error: {named}: "), r.stderr
        assert "internal error" not in r.stderr and "Traceback" not in r.stderr
