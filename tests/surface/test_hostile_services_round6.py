"""Red team round six (issue 34): the monitor across restarts and the CLI on hostile files.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers and real CLI processes in subprocesses (a hang or an abort must not take pytest along).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import REPO, eventually, listening_url, up

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job  # noqa: E402

from stragglers.trace.runformat import table_bytes, write_rank  # noqa: E402

TOKEN = "hostile-round6-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLI = [sys.executable, "-m", "stragglers.cli"]
# a liveness bound, not a timing verdict: a refusal takes a second, a blocked open forever
HANG_S = 30


def serve_monitor(tmp: Path, db: str, cwd: Path) -> tuple[subprocess.Popen, str]:
    """`stragglers monitor serve --db DB` started in `cwd`, as an operator does."""
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    cfg = tmp / "monitor.yaml"
    cfg.write_text("settings: {window_steps: 5, stall_after_s: 600, tick_s: 0.05}\n")
    proc = subprocess.Popen([*CLI, "monitor", "serve", "--db", db, "--port", "0", "--config",
                             str(cfg), "--token-file", str(token)], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return proc, listening_url(proc)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.communicate(timeout=60)


def upload(c: httpx.Client, trace, parts) -> None:
    """Job j's metadata and `parts` uploaded, each acknowledged."""
    assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(), headers=AUTH).status_code == 200
    for rank, n, cols in parts:
        r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols), headers=AUTH)
        assert r.status_code == 200, r.text


def as_typed(tmp: Path) -> tuple[str, Path, str, Path]:
    """Started as `--db mon.db` in its folder, then as `--db /abs/mon.db` from elsewhere."""
    return "mon.db", tmp, str(tmp / "mon.db"), REPO


def moved(tmp: Path) -> tuple[str, Path, str, Path]:
    """Started as `--db /a/mon.db`; its folder (store and uploads) moved to /b, started again."""
    (tmp / "a").mkdir()
    return str(tmp / "a" / "mon.db"), REPO, str(tmp / "b" / "mon.db"), REPO


@pytest.mark.slow
@pytest.mark.parametrize("paths", [
    # (an uploaded job's folder was the path its row kept, as typed at the first start:
    # relative, or absolute before the store and its uploads were moved)
    as_typed,
    moved,
], ids=["relative-then-absolute", "folder-moved"])
def test_monitor_started_again_by_another_path_to_its_store_keeps_its_jobs(tmp_path, paths):
    """The same store and uploads folder reached by another path at the next start: its job
    goes on — the last part is stored and the window it completes analysed. An uploaded job's
    folder is by construction the uploads folder's `job`: nothing to set aside."""
    db1, cwd1, db2, cwd2 = paths(tmp_path)
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    parts = parts_of(trace, 5)
    last = parts[-1]
    proc, url = serve_monitor(tmp_path, db1, cwd1)
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            upload(c, trace, parts[:-1])
            eventually(lambda: c.get("/api/jobs/j").json()["windows_total"] == 1,
                       what="window 0 analysed")
    finally:
        stop(proc)
    if paths is moved:
        (tmp_path / "a").rename(tmp_path / "b")
    proc, url = serve_monitor(tmp_path, db2, cwd2)
    try:
        assert up(proc, url), "the monitor did not start again"
        with httpx.Client(base_url=url, timeout=60) as c:
            rank, n, cols = last
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                      headers=AUTH)
            assert r.status_code == 200, r.text
            eventually(lambda: c.get("/api/jobs/j").json()["windows_total"] == 2,
                       timeout=60, what="window 1 analysed")
    finally:
        stop(proc)


def cli(*args: str, cwd: Path) -> tuple[int | None, str]:
    """(exit status, or None where it did not end within HANG_S; stderr) of one CLI command."""
    try:
        done = subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, timeout=HANG_S,
                              stdin=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    except subprocess.TimeoutExpired:
        return None, f"no end in {HANG_S} s"
    return done.returncode, done.stderr.decode(errors="replace")


def clean_refusal(status: int | None, err: str, names: str) -> None:
    """One line naming the file, exit 2: no hang, no 'internal error', no traceback."""
    assert status == 2, (status, err[-1500:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and names in lines[0] and "internal error" not in lines[0], err[-1500:]


def small_run(directory: Path) -> Path:
    """A recorder-style run directory: meta.json and one Parquet file per rank."""
    trace = slow_job(steps=4, slow=(0, 1, 3.0))
    directory.mkdir()
    (directory / "meta.json").write_text(json.dumps(trace.meta.to_dict()))
    o = trace.ops
    for rank in sorted(set(o["rank"].tolist())):
        write_rank(directory, rank, {k: v[o["rank"] == rank] for k, v in o.items()})
    return directory


def meta_fifo(run: Path) -> str:
    (run / "meta.json").unlink()
    os.mkfifo(run / "meta.json")
    return "meta.json"


def meta_nested(run: Path) -> str:
    (run / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    return "meta.json"


def rank_fifo(run: Path) -> str:
    (run / "rank-00003.parquet").unlink()
    os.mkfifo(run / "rank-00003.parquet")
    return "rank-00003.parquet"


@pytest.mark.slow
@pytest.mark.parametrize("spoil", [
    # (meta.json was read whole with read_bytes(), a rank file opened blocking: a FIFO hung
    # the analysis for good, 100,000 nested lists were "internal error: RecursionError")
    meta_fifo, meta_nested, rank_fifo,
], ids=["meta-fifo", "meta-nested", "rank-fifo"])
def test_analyze_refuses_a_run_file_it_cannot_read_in_one_line(tmp_path, spoil):
    """A run directory whose meta.json or a rank file is not a regular, bounded file: one line
    naming it, exit 2 (what the monitor's watcher and --config already do)."""
    run = small_run(tmp_path / "run")
    name = spoil(run)
    status, err = cli("analyze", str(run), cwd=tmp_path)
    clean_refusal(status, err, name)


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    # (read with read_text(): a FIFO hung advise for good; RecursionError was not caught)
    lambda p: os.mkfifo(p),
    lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
], ids=["fifo", "nested"])
def test_advise_refuses_a_calibration_file_it_cannot_read_in_one_line(tmp_path, make):
    """`advise --calibration FILE` on a FIFO or a JSON nested too deep: one line naming it."""
    run = small_run(tmp_path / "run")
    cal = tmp_path / "cal.json"
    make(cal)
    status, err = cli("advise", str(run), "--calibration", str(cal), "-q", cwd=tmp_path)
    clean_refusal(status, err, "cal.json")


def test_analyze_refuses_a_step_number_too_large_in_one_line(tmp_path):
    """`--steps 99999999999999999999999999999`: one line naming --steps, exit 2."""
    run = small_run(tmp_path / "run")
    status, err = cli("analyze", str(run), "--steps", "9" * 29, cwd=tmp_path)
    clean_refusal(status, err, "--steps")


@pytest.mark.slow
def test_monitor_refuses_a_store_that_is_not_a_file_in_one_line(tmp_path):
    """`monitor serve --db :memory:`: one line naming the store, exit 2."""
    proc, url = serve_monitor(tmp_path, ":memory:", tmp_path)
    try:
        proc.wait(timeout=HANG_S)   # a refusal ends at once; a service that took it serves on
    except subprocess.TimeoutExpired:
        pass
    alive = proc.poll() is None
    stop(proc)
    assert not alive and proc.returncode == 2 and not url, (proc.returncode, url)


CHROMIUM = Path("/usr/bin/chromium")
MARKUP_HOST = '<a href="https://evil.example/">phish</a><b style="font-size:90px">BIG</b>'


@pytest.mark.slow
@pytest.mark.browser
def test_dashboard_shows_a_host_name_as_text_not_markup(tmp_path):
    """A host name holding markup is shown as those characters in the heatmap's hover, never as
    a link or styled text (the rest of the page already sets names with textContent)."""
    if not CHROMIUM.exists():
        pytest.skip("system chromium not installed")
    from playwright.sync_api import sync_playwright
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    meta = trace.meta.to_dict()
    for entry in meta["extra"]["layout"]:
        entry["host"] = MARKUP_HOST
    proc, url = serve_monitor(tmp_path, "mon.db", tmp_path)
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=meta, headers=AUTH).status_code == 200
            for rank, n, cols in parts_of(trace, 5):
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                             headers=AUTH).status_code == 200
            eventually(lambda: c.get("/api/jobs/j").json()["windows_total"] == 2,
                       what="both windows analysed")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM),
                                         args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            page.goto(f"{url}/jobs/j")
            page.wait_for_selector("#heatmap .hoverlayer", state="attached", timeout=60_000)
            box = page.locator("#heatmap").bounding_box()
            assert box is not None
            hover = ""
            for _ in range(600):     # until the cell under the pointer shows its hover
                page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.7)
                hover = page.evaluate("() => Array.from(document.querySelectorAll("
                                      "'#heatmap .hovertext')).map(e => e.textContent).join()")
                if hover:
                    break
                page.mouse.move(1, 1)
                page.wait_for_timeout(100)
            links = page.evaluate("() => document.querySelectorAll('#heatmap .hovertext a')"
                                  ".length")
            browser.close()
    finally:
        stop(proc)
    assert "rank" in hover, hover
    assert links == 0 and MARKUP_HOST in hover, (links, hover)


@pytest.mark.slow
@pytest.mark.parametrize("second_db", ["mon.db", "link.db"], ids=["same-path", "via-a-symlink"])
def test_a_second_monitor_on_the_same_store_is_refused_or_analyses_every_part(tmp_path,
                                                                           second_db):
    """Two `monitor serve` on one SQLite file (a restart that overlapped, a second unit by
    mistake; or the same file by a symlink: a lock named after the path as typed misses it):
    the second is refused (exit 2), or every part either acknowledged is analysed."""
    (tmp_path / "link.db").symlink_to(tmp_path / "mon.db")
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    first, url1 = serve_monitor(tmp_path, str(tmp_path / "mon.db"), tmp_path)
    assert up(first, url1), "the monitor did not start"
    second, url2 = serve_monitor(tmp_path, str(tmp_path / second_db), tmp_path)
    try:
        if not url2:                                  # refused: what the fix may choose
            second.wait(timeout=60)
            assert second.returncode == 2
            return
        with httpx.Client(base_url=url1, timeout=60) as a, \
                httpx.Client(base_url=url2, timeout=60) as b:
            assert a.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for i, (rank, n, cols) in enumerate(parts_of(trace, 5)):
                r = (a, b)[i % 2].put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                                      content=table_bytes(cols), headers=AUTH)
                assert r.status_code == 200, r.text
            eventually(lambda: max(c.get("/api/jobs/j").json()["windows_total"]
                                   for c in (a, b)) == 2, timeout=60, what="both windows")
    finally:
        stop(first)
        stop(second)


@pytest.mark.slow
def test_two_monitors_sharing_an_uploads_folder_keep_each_acknowledged_part(tmp_path):
    """A's and B's stores differ, --data-dir is the same: B is refused (exit 2), or both
    acknowledged parts keep their bytes."""
    one = slow_job(steps=10, slow=(0, 1, 3.0), seed=1)
    two = slow_job(steps=10, slow=(1, 1, 3.0), seed=2)
    uploads = tmp_path / "uploads"
    stop(serve_monitor(tmp_path, str(tmp_path / "a.db"), tmp_path)[0])   # (writes the token)

    def monitor(db: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([*CLI, "monitor", "serve", "--db", str(tmp_path / db), "--port",
                                 "0", "--token-file", str(tmp_path / "token"), "--data-dir",
                                 str(uploads)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return proc, listening_url(proc)

    a, url_a = monitor("a.db")
    proc_b = None
    try:
        assert up(a, url_a), "the monitor did not start"
        proc_b, url_b = monitor("b.db")
        if not url_b:                                  # refused: what the fix may choose
            proc_b.wait(timeout=60)
            assert proc_b.returncode == 2
            return
        sent = []
        for url, trace in ((url_a, one), (url_b, two)):
            rank, n, cols = parts_of(trace, 5)[0]
            body = table_bytes(cols)
            with httpx.Client(base_url=url, timeout=60) as c:
                assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=body, headers=AUTH)
                assert r.status_code == 200 and r.json()["status"] == "stored", r.text
            sent.append(body)
        kept = {p.read_bytes() for p in uploads.rglob("*.parquet")}
        assert sent[0] in kept and sent[1] in kept, "an acknowledged part's bytes are gone"
    finally:
        stop(a)
        if proc_b is not None:
            stop(proc_b)


@pytest.mark.slow
def test_a_stored_part_replaced_on_disk_is_set_aside_not_analysed(tmp_path):
    """An acknowledged upload whose file holds other bytes when it is read back (another writer,
    a restored backup of another job): set aside as bad_part, never analysed as that part."""
    trace = slow_job(steps=10, slow=(0, 1, 3.0), seed=1)
    other = slow_job(steps=10, slow=(1, 1, 3.0), seed=2)   # same shape, other times
    parts, others = parts_of(trace, 5), parts_of(other, 5)
    proc, url = serve_monitor(tmp_path, str(tmp_path / "mon.db"), tmp_path)
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            upload(c, trace, parts[:-1])
    finally:
        stop(proc)
    rank, n, cols = others[-2]                 # rank 2's part 1, window 1 (not analysed yet)
    stored = tmp_path / "mon.db.uploads" / "j" / f"rank-{rank:05d}.part-{n:06d}.parquet"
    assert stored.exists()
    stored.write_bytes(table_bytes(cols))
    proc, url = serve_monitor(tmp_path, str(tmp_path / "mon.db"), tmp_path)
    try:
        assert up(proc, url), "the monitor did not start again"
        with httpx.Client(base_url=url, timeout=60) as c:
            rank, n, cols = parts[-1]
            assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                         headers=AUTH).status_code == 200
            rejects = eventually(lambda: c.get("/api/jobs/j").json()["windows_total"] == 2 or
                                 [x for x in c.get("/api/stats").json()["rejects"]
                                  if stored.name in x["source"]], timeout=60,
                                 what="window 1 analysed or the part set aside")
    finally:
        stop(proc)
    assert rejects is not True, "window 1 was analysed from bytes that are not the part stored"
