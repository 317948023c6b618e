"""Watching the nodes: `launch top`'s node-side sampler and its library (one row per node), the
PNG of a record, the Cloud Monitoring export, and a detached job's own sampling. No rich: the
CLI (launcher.cli.cmd_top) renders."""

from __future__ import annotations

from launcher.observe.cloud import CloudExporter
from launcher.observe.job_metrics import JobMetrics
from launcher.observe.plot import plot_record
from launcher.observe.sampler import node_program
from launcher.observe.top import NodeRow, TopSampler

__all__ = ["CloudExporter", "JobMetrics", "NodeRow", "TopSampler", "node_program", "plot_record"]
