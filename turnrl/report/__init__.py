"""Run reports: ``report.png`` (matplotlib learning curves) and ``report.html`` (one
self-contained page: curves as inline SVG, the evaluation table, sample conversations;
several runs on one page)."""

from turnrl.report.html import write_html_report
from turnrl.report.png import PREFERRED_METRICS, write_report

__all__ = ["PREFERRED_METRICS", "write_html_report", "write_report"]
