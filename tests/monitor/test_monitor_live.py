"""The whole path, live: a real torchrun of examples/train_gpt.py with a slow rank uploads its
parts to a real monitor process; a real Chromium shows the hot cell, the diagnosis naming the
rank, the alert; the slowness stops and the resolve appears, on the page and at a real webhook
receiver (Alertmanager's format)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from conftest import REPO, eventually, free_port
from monitor_jobs import get
from stragglers.trace.runformat import read_run

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SLOW_RANK = 1            # dp 0, stage 1 with --pp 2 (rank = dp * pp + stage)
STEPS, SLOW_UNTIL = 60, 30

pytestmark = [pytest.mark.distributed, pytest.mark.browser]


class Receiver(BaseHTTPRequestHandler):
    """A webhook receiver: keeps every JSON body it is sent."""

    bodies: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Receiver.bodies.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def wait_true(page, expression: str, timeout_s: float) -> None:
    """Poll a JavaScript expression until it is true (page.wait_for_function evaluates its
    predicate with eval, which the dashboard's Content-Security-Policy refuses)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout_s} s: {expression}"
        time.sleep(0.1)


def start_monitor(tmp: Path, port: int, webhook: str, token_file: Path) -> subprocess.Popen:
    rules = tmp / "rules.yaml"
    # hysteresis on the fault rule: on a loaded machine one window of the slow phase can dip
    # below the firing threshold (seen: fired, resolved, fired again), which a plain threshold
    # turns into a second alert
    rules.write_text(f"""
settings: {{window_steps: 5, stall_after_s: 600, close_grace_s: 2, tick_s: 0.2}}
rules:
  - {{name: severe, when: "slowdown >= 1.8", for_windows: 1, severity: critical}}
  - {{name: worker_fault, when: "cause == worker_fault and speedup >= 1.5", for_windows: 2,
      resolve_when: "speedup < 1.2", resolve_for_windows: 2, severity: critical}}
webhooks: ["{webhook}"]
external_url: "http://monitor.example:8150"
""")
    cmd = [sys.executable, "-m", "stragglers.monitor", "serve", "--db", str(tmp / "mon.db"),
           "--port", str(port), "--token-file", str(token_file), "--config", str(rules),
           "--data-dir", str(tmp / "uploads")]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def start_training(tmp: Path, url: str, token_file: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "examples/train_gpt.py", "--pp", "2",
           "--steps", str(STEPS), "--layers", "2", "--d-model", "32", "--max-seq-len", "64",
           "--slow-rank", str(SLOW_RANK), "--slow-factor", "6",
           "--slow-until-step", str(SLOW_UNTIL), "--flush-interval", "0.3",
           "--trace-dir", str(tmp / "live-gpt"), "--monitor-url", url,
           "--monitor-token-file", str(token_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def heat(page) -> list[list[float]]:
    return page.evaluate("document.getElementById('heatmap').data[0].z")


def test_live_dashboard_shows_the_slow_rank_alerts_and_resolves(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("system chromium not installed")
    from playwright.sync_api import sync_playwright

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    Receiver.bodies = []
    token = tmp_path / "token"
    token.write_text("live-test-token-0123\n")
    token.chmod(0o600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    monitor = start_monitor(tmp_path, port, f"http://127.0.0.1:{receiver.server_port}/alerts",
                            token)
    train = None
    try:
        with httpx.Client(base_url=url, timeout=30) as c, sync_playwright() as pw:
            eventually(lambda: c.get("/health").status_code == 200, 60, what="monitor up")
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            # The page is open before the job exists; all it shows later comes without a reload.
            # (history=3: the chart holds the last 3 windows, so the slow window the slider
            # goes back to below is fetched by its index, as a long job's old windows are)
            page.goto(f"{url}/jobs/live-gpt?history=3")
            # the page runs under the dashboard's Content-Security-Policy (no inline script, no
            # eval): nothing it does may be refused by it
            refused = []
            page.on("console", lambda m: refused.append(m.text)
                    if "Content Security Policy" in m.text else None)
            wait_true(page, "typeof Plotly !== 'undefined'", 120)
            assert page.inner_text("#shape") == "" and get(c, "/api/jobs")["jobs"] == []
            train = start_training(tmp_path, url, token)
            page.wait_for_selector("#shape:not(:empty)", timeout=300_000)
            page.wait_for_selector('#alert-log tr[data-rule="worker_fault"][data-status="firing"]',
                                   timeout=300_000)
            assert train.wait(timeout=400) == 0, train.stdout.read()[-3000:]
            # After the slowness stopped, the fault alert resolves (on the page, no reload).
            page.wait_for_selector('#alert-log tr[data-rule="worker_fault"]'
                                   '[data-status="resolved"]', timeout=240_000)
            eventually(lambda: get(c, "/api/jobs/live-gpt")["state"] == "finished", 120,
                       what="job finished")
            # The window slider goes back to the slow window where the diagnosis finds the
            # fault strongest: there the hot cell is rank 1's. (Not just any slow window: beside
            # a CPU hog, contention can lift every worker's S_w to ~2 in one window — S_w is
            # min(S_dp, S_pp), which cannot separate a ×6 worker from a machine-wide ×2 — while
            # the diagnosis still names rank 1 there, at a smaller gain.)
            job = get(c, "/api/jobs/live-gpt")
            slow = {}
            for w in job["windows"]:
                if w["last_step"] >= SLOW_UNTIL:
                    continue
                gains = [f["speedup_if_fixed"] for f in get(
                    c, f"/api/jobs/live-gpt/windows/{w['idx']}")["diagnosis"]
                    if f["cause"] == "worker_fault" and SLOW_RANK in f["ranks"]]
                if gains:
                    slow[w["idx"]] = max(gains)
            assert slow, job["windows"]
            idx = max(slow, key=slow.get)
            page.uncheck("#follow")
            page.eval_on_selector("#window-slider", f"(el) => {{ el.value = {idx}; "
                                  "el.dispatchEvent(new Event('input')); }")
            wait_true(page, f"document.getElementById('window-label').textContent"
                      f".startsWith('#{idx}:')", 30)
            text = page.inner_text('#diagnosis li[data-cause="worker_fault"]')
            assert f"rank {SLOW_RANK}" in text.split(":")[0]     # the headline names the rank
            # S is said to be the window's, over its steps, not the whole run's
            summary = page.inner_text("#summary")
            assert f"(window {idx};" in summary and "over steps" in summary, summary
            z = heat(page)
            hottest = max((v, pp, dp) for pp, row in enumerate(z) for dp, v in enumerate(row)
                          if v is not None)
            assert (hottest[1], hottest[2]) == (SLOW_RANK % 2, SLOW_RANK // 2), z
            assert hottest[0] > 1.3
            hover = page.evaluate("document.getElementById('heatmap').data[0].text")
            assert f"rank {SLOW_RANK}" in hover[SLOW_RANK % 2][SLOW_RANK // 2]
            page.screenshot(path=str(tmp_path / "job.png"), full_page=True)
            assert not refused, refused
            browser.close()
            # Everything the recorder flushed arrived exactly once.
            local = read_run(tmp_path / "live-gpt")
            stats = get(c, "/api/stats")
            assert stats["by_way"]["http"]["records"] == len(local)
            assert len(read_run(tmp_path / "uploads" / "live-gpt")) == len(local)
        # The webhook receiver got Alertmanager-format messages: firing, then resolved.
        fault = [b for b in Receiver.bodies if b["groupLabels"]["alertname"] == "worker_fault"
                 and b["alerts"][0]["labels"].get("rank") == str(SLOW_RANK)]
        statuses = [b["status"] for b in fault]
        assert statuses[:1] == ["firing"] and "resolved" in statuses, statuses
        body = fault[0]
        assert body["version"] == "4" and body["externalURL"] == "http://monitor.example:8150"
        alert = body["alerts"][0]
        assert alert["labels"]["job"] == "live-gpt" and alert["labels"]["severity"] == "critical"
        assert alert["generatorURL"] == "http://monitor.example:8150/jobs/live-gpt"
        assert statuses.count("firing") == 1      # de-duplicated while it kept firing
    finally:
        for proc in (train, monitor):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()    # a failed run must not leave its pipes to the next test
        receiver.shutdown()
