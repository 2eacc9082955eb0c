"""The `stragglers` command tree: every command's --help works, old names still run."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
import typer.main

from stragglers.cli import app


def _walk(command: click.Command, path: tuple[str, ...] = ()):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _walk(sub, path + (name,))


COMMANDS = list(_walk(typer.main.get_command(app)))


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "root")
def test_help_of_every_command(path):
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", *path, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Usage" in proc.stdout


def test_every_command_has_a_help_line():
    missing = [" ".join(p) for p, c in COMMANDS if p and not (c.help or c.short_help)]
    assert not missing


def test_deprecated_aliases_are_hidden_and_say_so():
    for path, command in COMMANDS:
        if getattr(command, "deprecated", False):
            assert command.hidden, f"{' '.join(path)} is deprecated but listed"
            assert "use `stragglers" in (command.help or "").lower() or \
                "use 'stragglers" in (command.help or "").lower(), " ".join(path)


def test_version_and_exit_codes():
    from stragglers import __version__

    out = subprocess.run([sys.executable, "-m", "stragglers.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"stragglers {__version__}"
    bad = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", "/nonexistent/run"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "/nonexistent/run" in bad.stderr and "Traceback" not in bad.stderr
