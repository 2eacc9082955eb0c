"""Reports of a what-if analysis: rich console summary, offline HTML page, Perfetto timelines."""

from stragglers.report.console import print_report
from stragglers.report.html import render_html, write_html
from stragglers.report.perfetto import write_perfetto
from stragglers.report.summary import Summary, summarize

__all__ = ["Summary", "print_report", "render_html", "summarize", "write_html", "write_perfetto"]
