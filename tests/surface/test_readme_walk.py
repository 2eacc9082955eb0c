"""The README followed top to bottom by a newcomer: every shell block, in order, in a fresh clone,
exits 0 — so a command of the README can never again fail when followed.

The clone is this repository's HEAD plus the working tree's changes (edits, and files not yet
added that git does not ignore), so it runs the code under test; nothing ignored (runs/, build
outputs) comes along. It sits beside a link to ../shared, as a checkout does, and reuses this
checkout's .venv (linked, never rebuilt). Long runs are shortened
by their own documented flags (SHORTER); a torchrun job the walk already ran is run once
(RUN_ONCE); `make test` is the suite this test belongs to.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port, kill_tree

README = REPO / "README.md"
VENV = REPO / ".venv"

# Replacements applied to the blocks, each a documented flag of its command: the walk checks
# that every command runs as written; the full-length runs are measured elsewhere.
MONITOR_PORT, SHARDS_PORT = free_port(), free_port()
# The public NDTimeline samples, as this checkout has them beside it (the machine has no GitHub).
SAMPLES = REPO.parent / "shared" / "data" / "ndtimeline-samples"
SHORTER = [
    ("make samples", f"make samples SAMPLES_FROM={SAMPLES}"),           # a local mirror
    # (DEMO_STEPS as the recorded-job example's --steps below: its training is then the same
    # job, run once: RUN_ONCE)
    ("make demo ", "make demo DEMO_STEPS=5 WATCH_STEPS=10 DEMO_PORT=0 "),  # Makefile variables
    ("monitor serve --db", f"monitor serve --port {MONITOR_PORT} --db"),  # 8150 may be taken
    ("adapt serve --db", f"adapt serve --port {SHARDS_PORT} --db"),        # 8151 too
    ("--steps 200", "--steps 10"),                                   # train_gpt.py --steps
    # the recorded-job examples: each step costs CPU (~0.5 s of train_gpt's 4 ranks), what the
    # walk checks (the command and the analysis of its run exit 0) is the same at 5 or 3 steps
    ("--pp 2 --steps 20 ", "--pp 2 --steps 5 "),                       # train_gpt.py
    ("--steps 8 ", "--steps 3 "),                                     # train_tp.py, train_moe.py
    ("train_coded.py --scheme", "train_coded.py --steps 10 --scheme"),
    ("train_adaptive.py --policy", "train_adaptive.py --steps 20 --policy"),
]
SKIPPED = {"make test": "the test suite, which this test is part of"}
# Long examples end with a verdict line (what the run showed), printed by rank 0.
VERDICT_EXAMPLES = ("examples/train_coded.py", "examples/train_adaptive.py")
BLOCK_TIMEOUT_S = 300
# RUN_ONCE: a torchrun job the walk has already run, to the letter but for where its trace
# goes and the launcher's rendezvous port, is run once: a later README command of that job
# copies the first run's trace to its own --trace-dir instead (a 4-process job costs ~17 s of
# CPU, nearly all of it its processes starting: ~3.5 s each; its steps ~0.2 s). `make demo`
# prints the training it runs ("[demo] $"): the recorded-job example's training is that job.
RUN_ONCE_NOTE = "# run once: the same job as"
DEMO_RAN = re.compile(r"^\[demo\] \$ -m torch\.distributed\.run (.*)$", re.M)


def shell_blocks(text: str) -> list[str]:
    """The ```sh blocks of a Markdown text, dedented (blocks inside list items are indented)."""
    blocks, current, indent = [], None, 0
    for line in text.splitlines():
        fence = re.match(r"^(\s*)```(\w*)\s*$", line)
        if current is None and fence and fence.group(2) in ("sh", "bash", "shell"):
            current, indent = [], len(fence.group(1))
        elif current is not None and fence and not fence.group(2):
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line[indent:])
    return blocks


def as_walked(block: str) -> str:
    """The block with SKIPPED commands left out and SHORTER applied."""
    kept = [line for line in block.splitlines()
            if not any(line.split("#")[0].strip() == cmd for cmd in SKIPPED)]
    text = "\n".join(kept)
    for old, new in SHORTER:
        text = text.replace(old, new)
    return text


def torchrun_job(argv: list[str], clone: Path) -> tuple[tuple, str] | None:
    """(the job: script, process count and its other flags; its --trace-dir) of a torchrun
    command's arguments after the launcher's name, or None where it is no recorded job."""
    launcher, rest = {}, list(argv)
    while rest and rest[0].startswith("--"):
        flag, _, value = rest.pop(0)[2:].partition("=")
        launcher[flag] = value if value or flag == "standalone" else rest.pop(0)
    if not rest or "--trace-dir" not in rest[1:-1]:
        return None
    script, args = rest[0], rest[1:]
    at = args.index("--trace-dir")
    trace_dir = args[at + 1]
    # (a number as its value: the demo passes --slow-factor 3.0 where the README says 3)
    flags = [_number(word) for word in args[:at] + args[at + 2:]]
    launcher.pop("rdzv-endpoint", None)   # (a free port of the run's own)
    where = Path(script) if Path(script).is_absolute() else clone / script
    return (str(where.resolve()), tuple(sorted(launcher.items())), tuple(flags)), trace_dir


def _number(word: str) -> str | float:
    try:
        return float(word)
    except ValueError:
        return word


def run_once(walked: str, clone: Path, ran: dict[tuple, str]) -> str:
    """`walked` with each torchrun job in `ran` (job: its trace) copied from that run's trace
    instead of run again; the jobs it runs itself added to `ran`."""
    out = []
    for command in re.split(r"(?<!\\)\n", walked):
        words = shlex.split(command.replace("\\\n", " "), comments=True)
        job = torchrun_job(words[1:], clone) if words[:1] == ["torchrun"] else None
        if job and job[0] in ran:
            first, trace_dir = ran[job[0]], shlex.quote(job[1])
            command = f"rm -rf {trace_dir} && cp -r {shlex.quote(first)} {trace_dir}" \
                      f"   {RUN_ONCE_NOTE} {first}'s"
        elif job:
            ran[job[0]] = job[1]
        out.append(command)
    return "\n".join(out)


def test_readme_blocks_are_found_and_every_shortening_still_applies():
    blocks = shell_blocks(README.read_text())
    assert len(blocks) >= 6, "the README's shell blocks were not found"
    text = "\n".join(blocks)
    for old, _ in SHORTER:
        assert old in text, f"SHORTER entry {old!r} matches no README command any more"
    for cmd in SKIPPED:
        assert cmd in text, f"SKIPPED entry {cmd!r} matches no README command any more"


def fresh_clone(tmp: Path) -> tuple[Path, set[str]]:
    """HEAD + the working tree's changes, beside ../shared, with the venv linked; and the
    not-yet-added files copied in (not strays of the walk)."""
    clone = tmp / "stragglers"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True,
                   timeout=300)
    diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--binary"], check=True,
                          capture_output=True, timeout=120).stdout
    if diff.strip():
        subprocess.run(["git", "-C", str(clone), "apply", "--whitespace=nowarn"], input=diff,
                       check=True, timeout=120)
    added = subprocess.run(["git", "-C", str(REPO), "ls-files", "--others", "--exclude-standard",
                            "-z"], check=True, capture_output=True, text=True, timeout=120)
    copied = {name for name in added.stdout.split("\0") if name and (REPO / name).is_file()}
    for name in copied:
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, clone / name)
    shared = REPO.parent / "shared"
    if shared.exists():
        (tmp / "shared").symlink_to(shared)
    (clone / ".venv").symlink_to(VENV)
    # `make demo` depends on the venv's stamp: keep the clone's pyproject.toml older than it, so
    # make uses the linked venv instead of rebuilding it
    stamp = (VENV / ".installed").stat().st_mtime
    os.utime(clone / "pyproject.toml", (stamp - 60, stamp - 60))
    return clone, copied


def newcomer_env(clone: Path) -> dict:
    """The environment after `source .venv/bin/activate` in the clone (its own sources first)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(VIRTUAL_ENV=str(clone / ".venv"), PATH=f"{clone / '.venv' / 'bin'}:{env['PATH']}",
               PYTHONPATH=str(clone / "src"), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONUNBUFFERED="1", COLUMNS="100")
    return env


def run_block(block: str, clone: Path, env: dict) -> subprocess.CompletedProcess:
    """One block as a bash script with -e (a newcomer sees every failing line), in its own
    session; whatever it left running in the background is stopped afterwards."""
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block], cwd=clone, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        err += f"\n(timed out after {BLOCK_TIMEOUT_S} s)"
    finally:
        kill_tree(proc)
    return subprocess.CompletedProcess(block, proc.returncode, out, err)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_every_readme_shell_block_runs_in_order_in_a_fresh_clone(tmp_path):
    if not (REPO / ".git").exists() or not (VENV / ".installed").exists():
        pytest.skip("needs a git checkout with its venv built (make venv)")
    if not SAMPLES.exists():
        pytest.skip(f"the README's `make samples` is walked with a local mirror, {SAMPLES}: absent")
    clone, copied = fresh_clone(tmp_path)
    env = newcomer_env(clone)
    timings, ran, reused = [], {}, 0
    for i, block in enumerate(shell_blocks(README.read_text()), 1):
        walked = run_once(as_walked(block), clone, ran)
        reused += walked.count(RUN_ONCE_NOTE)
        if not walked.strip():
            continue
        t0 = time.monotonic()
        proc = run_block(walked, clone, env)
        timings.append(f"block {i}: {time.monotonic() - t0:.0f} s")
        errors = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("error"))
        assert proc.returncode == 0, (
            f"README shell block {i} failed (exit {proc.returncode}):\n{walked}\n"
            f"--- error lines\n{errors}\n"
            f"--- stdout (end)\n{proc.stdout[-3000:]}\n--- stderr (end)\n{proc.stderr[-5000:]}")
        for launched in DEMO_RAN.findall(proc.stdout):
            job = torchrun_job(shlex.split(launched), clone)
            if job:
                ran.setdefault(job[0], job[1])
        if any(example in walked for example in VERDICT_EXAMPLES):
            last = (proc.stdout.strip().splitlines() or [""])[-1]
            assert last.startswith("verdict: "), f"block {i} ends without a verdict:\n{proc.stdout}"
    print("README walk:", ", ".join(timings), f"({reused} torchrun job(s) not run again)")
    # Everything the README writes goes under runs/ or is ignored: no stray files in the clone.
    status = subprocess.run(["git", "-C", str(clone), "status", "--porcelain",
                             "--untracked-files=all"], capture_output=True, text=True, check=True)
    stray = [line[3:] for line in status.stdout.splitlines()
             if line.startswith("??") and line[3:] not in copied]
    assert not stray, f"README commands left untracked files in the repository: {stray[:10]}"


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text."""
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


@pytest.mark.slow
def test_the_readme_library_call_prints_what_the_readme_says(tmp_path):
    # The block that needs no training job (the others use a model of the reader's own); the
    # comment line after a print is the output the README promises.
    block = next(b for b in python_blocks(README.read_text()) if "st.analyze(" in b)
    if not SAMPLES.exists():
        pytest.skip(f"the README's analyze example reads `make samples`' files, from {SAMPLES}: absent")
    # where `make samples` puts them, in a directory of its own (this checkout's runs/ untouched)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "samples").symlink_to(SAMPLES)
    lines = block.splitlines()
    promised = [lines[i + 1][2:] for i, line in enumerate(lines[:-1])
                if line.startswith("print(") and lines[i + 1].startswith("# ")]
    assert promised, "the README's analyze example no longer shows its output"
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    for line in promised:
        assert line in printed, (line, printed[:5])
