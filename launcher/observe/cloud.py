"""`launch top --cloud-monitoring`: the view's samples written to Cloud Monitoring as custom
metrics, through google-cloud-monitoring's `MetricServiceClient.create_time_series`
(https://cloud.google.com/monitoring/custom-metrics/create, "Write metric data").

Each node is a `generic_node` monitored resource (labels project_id, location, namespace,
node_id: https://cloud.google.com/monitoring/api/resources#tag_generic_node), the cluster's
name as namespace and the node's host as node_id; each gauge of its row is one time series of
`custom.googleapis.com/gpufleet/top/<name>` (DOUBLE, GAUGE), labelled with the node's rank.

Cloud Monitoring takes at most one point per time series every 5 s and at most 200 time series
per request (https://cloud.google.com/monitoring/quotas, "Custom metrics"), so the newest row of
every node is written every `period_s` (10 s unless the view's interval is longer), in batches
of 200; a node with no new sample since the last write is skipped (a point must be newer than
the series' last one). A failed write is logged once per distinct reason; the view goes on.

google-cloud-monitoring is imported only here (the `monitoring` extra).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from launcher.core.types import Cluster, UserError
from launcher.observe.top import NodeRow, NodeStatus

__all__ = ["METRIC_PREFIX", "GAUGES", "MAX_SERIES_PER_REQUEST", "MIN_PERIOD_S", "time_series", "CloudExporter"]

log = logging.getLogger("launcher")

METRIC_PREFIX = "custom.googleapis.com/gpufleet/top/"
# The metric's name -> the NodeRow attribute it carries (the --record fields of the same name).
GAUGES = {
    "gpu_util_mean_pct": "gpu_util_mean",
    "gpu_util_min_pct": "gpu_util_min",
    "gpu_mem_used_mib": "gpu_mem_used_mib",
    "gpu_power_w": "gpu_power_w",
    "gpu_temp_max_c": "gpu_temp_c",
    "cpu_util_pct": "cpu_util_pct",
    "host_rx_gbps": "host_rx",
    "host_tx_gbps": "host_tx",
    "gpu_nic_rx_gbps": "gpu_rx",
    "gpu_nic_tx_gbps": "gpu_tx",
    "gpu_nic_slowest_rx_gbps": "gpu_slowest_rx",
    "gpu_nic_slowest_tx_gbps": "gpu_slowest_tx",
    "data_gbps": "data_gbps",
}
MAX_SERIES_PER_REQUEST = 200
MIN_PERIOD_S = 10.0


def _monitoring() -> Any:
    try:
        from google.api import metric_pb2
        from google.cloud import monitoring_v3
    except ImportError:
        raise UserError(
            "--cloud-monitoring needs google-cloud-monitoring: pip install 'gpufleet[monitoring]'"
        ) from None
    return monitoring_v3, metric_pb2.MetricDescriptor


def time_series(rows: Sequence[NodeRow], cluster: Cluster, project: str) -> list[Any]:
    """One `monitoring_v3.TimeSeries` (one point) per gauge each answering node reports."""
    mv3, descriptor = _monitoring()
    out = []
    for row in rows:
        if row.status is not NodeStatus.OK or row.received is None:
            continue
        when = row.received
        interval = mv3.TimeInterval({"end_time": {"seconds": int(when), "nanos": int((when % 1) * 1e9)}})
        resource = {
            "type": "generic_node",
            "labels": {
                "project_id": project,
                "location": cluster.zone or "global",
                "namespace": cluster.name,
                "node_id": row.node.host,
            },
        }
        for name, attr in GAUGES.items():
            value = getattr(row, attr)
            if value is None:
                continue
            ts = mv3.TimeSeries()
            ts.metric.type = METRIC_PREFIX + name
            ts.metric.labels["rank"] = str(row.node.rank)
            ts.resource.type = resource["type"]
            ts.resource.labels.update(resource["labels"])
            ts.metric_kind = descriptor.MetricKind.GAUGE
            ts.value_type = descriptor.ValueType.DOUBLE
            ts.points = [mv3.Point({"interval": interval, "value": {"double_value": float(value)}})]
            out.append(ts)
    return out


class CloudExporter:
    """Writes `rows()` (the view's newest row per node) every `period_s` until `stop()`.

    `client` is a `monitoring_v3.MetricServiceClient` (default: one with the application default
    credentials; `endpoint` HOST:PORT: one over an insecure channel to a local stand-in, for tests)."""

    def __init__(
        self,
        cluster: Cluster,
        project: str,
        rows: Callable[[], list[NodeRow]],
        period_s: float,
        client: Any = None,
        endpoint: str | None = None,
    ):
        mv3, _ = _monitoring()
        if client is None:
            if endpoint:
                import grpc
                from google.cloud.monitoring_v3.services.metric_service.transports import MetricServiceGrpcTransport

                client = mv3.MetricServiceClient(
                    transport=MetricServiceGrpcTransport(channel=grpc.insecure_channel(endpoint))
                )
            else:
                client = mv3.MetricServiceClient()
        self.client, self.cluster, self.project = client, cluster, project
        self.period_s = max(MIN_PERIOD_S, period_s)
        self._rows = rows
        self._last: dict[int, float] = {}  # rank -> the received time of its last written row
        self._errors: set[str] = set()
        self.written = 0  # time series written
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="top-cloud-monitoring")

    def start(self) -> "CloudExporter":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Write what is new once more, then end."""
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            last = self._stop.wait(self.period_s)
            try:
                self.write_once()
            except Exception:  # the view must outlive its export
                log.exception("writing to Cloud Monitoring failed")
            if last:
                return

    def write_once(self) -> int:
        """Write every node's row that is new since the last write; how many series were written."""
        rows = [r for r in self._rows() if r.received is not None and r.received > self._last.get(r.node.rank, 0.0)]
        series = time_series(rows, self.cluster, self.project)
        done = 0
        for i in range(0, len(series), MAX_SERIES_PER_REQUEST):
            batch = series[i : i + MAX_SERIES_PER_REQUEST]
            try:
                self.client.create_time_series(name=f"projects/{self.project}", time_series=batch)
            except Exception as e:  # the API's errors (google.api_core.exceptions) and the network's
                why = f"{type(e).__name__}: {e}"
                if why not in self._errors:
                    self._errors.add(why)
                    log.warning("Cloud Monitoring refused %d time series: %s", len(batch), why)
                continue
            done += len(batch)
        for r in rows:
            self._last[r.node.rank] = r.received
        self.written += done
        return done
