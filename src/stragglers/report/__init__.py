"""Reports of a what-if analysis: rich console summary, offline HTML page, Perfetto timelines.

Every report reads an `AnalysisResult` (stragglers.whatif.result), or its JSON form read back.
"""

from stragglers.report.console import print_report
from stragglers.report.html import render_html, write_html
from stragglers.report.perfetto import write_perfetto
from stragglers.report.summary import as_result

__all__ = ["as_result", "print_report", "render_html", "write_html", "write_perfetto"]
