"""How the reports word their numbers: no interval printed as one number twice, no share past 1."""

from __future__ import annotations

from report_results import straggling_result

from stragglers.report import render_html
from stragglers.report.summary import interval_words


def test_an_interval_never_reads_as_one_number_twice():
    assert interval_words(1.21, 1.29) == " (interval 1.21–1.29)"
    assert interval_words(1.1581, 1.1612) == " (interval 1.158–1.161)"  # was "1.16–1.16"
    assert interval_words(1.16, 1.16) == " (the same on every resample of the steps)"


def test_a_fix_fraction_past_one_is_not_called_a_share():
    result = straggling_result()
    result["M_S"] = 1.214
    page = render_html(result)
    assert "share of the excess fixed by the top 3% workers" in page       # M_W 0.61: a share
    assert "share of the excess fixed by the last stage" not in page        # 1.214: not one
    assert "fix fraction of the last stage, outside 0–1 (see below)" in page
    assert "M_S &gt; 1" in page or "M_S > 1" in page                      # the note says why
