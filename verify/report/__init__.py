"""Reports of a ``verify run``: the terminal summary, JSON and Markdown.

``model`` holds the :class:`Report` (its verdict and the JSON); ``fold`` folds the results
into what a reader acts on (each failing case to its root cause, per candidate and version:
known findings, hazards, failures no finding explains); ``text`` and ``markdown`` render it.
"""

from verify.report.fold import CandidateFindings, CaseOutcome, FindingHit, fold
from verify.report.markdown import (
    MARKDOWN_COMPARISON_ROWS,
    MARKDOWN_TABLE_ROWS,
    render_markdown,
    render_table_markdown,
    write_markdown,
)
from verify.report.model import REPORT_SCHEMA_VERSION, Report
from verify.report.text import (
    MAX_FAILURES_SHOWN,
    candidates_line,
    render_table_text,
    render_text,
    verdict_line,
)

__all__ = ["MARKDOWN_COMPARISON_ROWS", "MARKDOWN_TABLE_ROWS", "MAX_FAILURES_SHOWN",
           "REPORT_SCHEMA_VERSION", "CandidateFindings", "CaseOutcome", "FindingHit", "Report",
           "candidates_line", "fold", "render_markdown", "render_table_markdown",
           "render_table_text", "render_text", "verdict_line", "write_markdown"]
