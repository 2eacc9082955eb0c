"""The HTML report: one self-contained offline page, checked in a real headless Chromium."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from report_results import clean_result, json_round_trip, straggling_result

from stragglers.report import render_html, write_html

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.mark.slow
def test_page_is_self_contained(tmp_path):
    path = write_html(json_round_trip(straggling_result()), tmp_path / "sub" / "report.html")
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    # No external scripts, styles or fonts: everything needed is inline.
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert not re.search(r"<link[^>]*\bhref=", page)
    assert not re.search(r"""\bsrc=["']?(https?:)?//""", page)  # no remote images either
    assert "Plotly.newPlot" in page and len(page) > 3_000_000  # plotly.js itself is inline
    for sid in ("headline", "explanation", "notes", "warnings", "diagnosis", "combined",
                "heatmap", "steps", "optypes", "stages"):
        assert f'id="{sid}"' in page, sid
    assert "gpt-13b-run7" in page and "1.452" in page and "31.1%" in page
    assert "Worker fault" in page and "1.25× faster" in page


@pytest.mark.slow
def test_clean_job_page_says_the_attribution_was_skipped():
    page = render_html(clean_result())
    assert "not straggling" in page
    assert page.count("Attribution skipped: S = 1.012 &lt; 1.03") == 3  # heatmap, op types, stages
    assert 'id="steps-plot"' in page and 'id="heatmap-plot"' not in page
    assert 'id="warnings"' not in page  # nothing to warn about


def test_a_poor_replay_fit_is_a_warning():
    result = clean_result()
    result["sim_error"] = 0.072
    page = render_html(result)
    assert 'id="warnings"' in page and "more than 5%" in page and "7.20%" in page


def test_text_from_the_result_is_escaped():
    result = straggling_result()
    result["job"]["name"] = "<script>alert(1)</script>"
    result["diagnosis"][0]["evidence"] = "<img src=x onerror=alert(2)>"
    page = render_html(result)
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page
    assert "<img src=x" not in page


@pytest.mark.browser
def test_page_renders_offline_in_headless_chromium(tmp_path):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install it with `make browser` "
                    "(apt-get install chromium); this test must run, not skip")
    from playwright.sync_api import sync_playwright

    path = write_html(straggling_result(), tmp_path / "report.html")
    network_requests: list[str] = []
    page_errors: list[str] = []

    def block(route):
        network_requests.append(route.request.url)
        route.abort()

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
            context.route(re.compile(r"^(https?|wss?)://"), block)
            page = context.new_page()
            page.set_default_timeout(60_000)  # generous: CI machines are shared and slow
            page.on("pageerror", lambda err: page_errors.append(str(err)))
            page.goto(path.as_uri(), wait_until="load")
            # plotly draws into an svg inside the figure div once plotly.js has run.
            page.wait_for_selector("#heatmap .plotly svg.main-svg")
            assert page.locator("#heatmap .plotly").count() == 1
            cells = page.eval_on_selector_all("#heatmap svg text",
                                              "els => els.map(e => e.textContent)")
            assert "1.38" in cells  # the faulty worker's cell is drawn with its value
            for sid in ("steps", "optypes", "stages"):
                assert page.locator(f"#{sid} .plotly svg.main-svg").count() >= 1, sid
            diagnosis = page.locator("#diagnosis")
            assert diagnosis.is_visible()
            text = diagnosis.inner_text()
            assert "Worker fault — worker dp 2 / pp 1." in text
            assert "1.25× faster" in text
            assert page.locator("#headline").inner_text().count("1.452") == 1
            # What the trace cannot show, and the combined prediction, are on the page.
            notes = page.locator("#notes")
            assert notes.is_visible() and "2 of 128 ranks read" in notes.inner_text()
            combined = page.locator("#combined").inner_text()
            assert "Fixing all 4 listed causes together: 1.41× faster" in combined
            assert "unexplained: 17%" in combined
            assert page.title() == "Straggler report — gpt-13b-run7"
        finally:
            browser.close()
    assert not page_errors, page_errors
    assert not network_requests, f"the page tried to reach the network: {network_requests}"


def _overlapping(boxes: list[list[float]]) -> list[tuple[int, int]]:
    """Pairs of [left, right, top, bottom] boxes that intersect."""
    return [(i, j) for i, a in enumerate(boxes) for j, b in enumerate(boxes[i + 1:], i + 1)
            if a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]]


@pytest.mark.browser
def test_a_long_run_s_chart_keeps_its_labels_apart(tmp_path):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install it with `make browser`")
    from playwright.sync_api import sync_playwright

    result = straggling_result()
    # 200 steps, S just above the straggling line: both line labels near the same height
    result["step_slowdown"] = {step: 1.10 + 0.02 * ((step * 7) % 5) / 4 for step in range(200)}
    result["slowdown"] = 1.115
    path = write_html(result, tmp_path / "report.html")
    boxes = "els => els.map(e => { const b = e.getBoundingClientRect(); " \
            "return [b.left, b.right, b.top, b.bottom]; })"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(offline=True, viewport={"width": 1280, "height": 900}) \
                .new_page()
            page.set_default_timeout(60_000)
            page.goto(path.as_uri(), wait_until="load")
            page.wait_for_selector("#steps .plotly svg.main-svg")
            ticks = page.eval_on_selector_all("#steps .xtick text", boxes)
            labels = page.eval_on_selector_all("#steps .xtick text",
                                               "els => els.map(e => e.textContent)")
            notes = page.eval_on_selector_all("#steps .annotation", boxes)
        finally:
            browser.close()
    assert 5 <= len(ticks) <= 15, labels          # a readable number of step labels
    assert all(label.isdigit() for label in labels), labels  # whole steps only
    assert not _overlapping(ticks), labels
    assert len(notes) == 2 and not _overlapping(notes)  # "job S" and "straggling" apart
