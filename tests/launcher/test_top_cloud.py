"""`launch top --cloud-monitoring` against a local stand-in for Cloud Monitoring's
`MetricService.CreateTimeSeries`, served over gRPC (the transport google-cloud-monitoring's
`MetricServiceClient` uses), that checks each request as the real API does.

What the stand-in enforces, from the API reference
(https://cloud.google.com/monitoring/api/ref_v3/rpc/google.monitoring.v3#createtimeseriesrequest)
and the limits (https://cloud.google.com/monitoring/quotas): `name` is `projects/PROJECT_ID` and
matches the routing header; 1 to 200 time series per request, none twice; a user-defined metric
type under `custom.googleapis.com/`; a `generic_node` resource with exactly its labels
(project_id, location, namespace, node_id); exactly one point, a GAUGE's interval without a
start time, a DOUBLE value; each point newer than the series' last, and at least 5 s after it.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from urllib.parse import unquote

import grpc
import pytest
from click.testing import CliRunner

from launcher.cli.cmd_top import top
from launcher.cluster.discovery import local_cluster
from launcher.core.types import Cluster, Node
from launcher.observe.top import NodeRow, NodeStatus

monitoring_v3 = pytest.importorskip("google.cloud.monitoring_v3")
from google.api.metric_pb2 import MetricDescriptor  # noqa: E402
from google.protobuf import empty_pb2  # noqa: E402

from launcher.observe.cloud import GAUGES, METRIC_PREFIX, CloudExporter, time_series  # noqa: E402

_GENERIC_NODE = {"project_id", "location", "namespace", "node_id"}
_MIN_GAP_S = 5.0


class FakeMonitoring:
    """CreateTimeSeries on 127.0.0.1:<port>; `series` holds every accepted point by series key."""

    def __init__(self) -> None:
        self.series: dict[tuple, list[tuple[float, float]]] = {}
        self.requests = 0
        self.refused: list[str] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.method_handlers_generic_handler(
            "google.monitoring.v3.MetricService",
            {
                "CreateTimeSeries": grpc.unary_unary_rpc_method_handler(
                    self._create,
                    request_deserializer=monitoring_v3.CreateTimeSeriesRequest.deserialize,
                    response_serializer=empty_pb2.Empty.SerializeToString,
                )
            },
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0)

    def _create(self, req, context):
        try:
            points = self._check(req, dict(context.invocation_metadata()))
        except ValueError as e:
            with self._lock:
                self.refused.append(str(e))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._lock:
            for key, when, value in points:
                self.series.setdefault(key, []).append((when, value))
            self.requests += 1
        return empty_pb2.Empty()

    def _check(self, req, metadata: dict) -> list[tuple[tuple, float, float]]:
        if not req.name.startswith("projects/") or "/" in req.name[len("projects/") :]:
            raise ValueError(f"name {req.name!r} is not projects/PROJECT_ID")
        params = dict(kv.split("=", 1) for kv in metadata.get("x-goog-request-params", "").split("&") if "=" in kv)
        if unquote(params.get("name", "")) != req.name:
            raise ValueError("the routing header (x-goog-request-params) does not name the request's project")
        if not 1 <= len(req.time_series) <= 200:
            raise ValueError(f"{len(req.time_series)} time series; 1 to 200 per request")
        out, seen = [], set()
        for ts in req.time_series:
            if not ts.metric.type.startswith("custom.googleapis.com/"):
                raise ValueError(f"metric type {ts.metric.type!r} is not user-defined")
            if ts.resource.type != "generic_node" or set(ts.resource.labels) != _GENERIC_NODE:
                raise ValueError(f"resource {ts.resource.type} {dict(ts.resource.labels)} is not a generic_node")
            if ts.resource.labels["project_id"] != req.name.split("/")[1]:
                raise ValueError("the resource's project_id is not the request's project")
            if len(ts.points) != 1:
                raise ValueError(f"{len(ts.points)} points; a write takes exactly one per time series")
            p = ts.points[0]
            if ts.metric_kind != MetricDescriptor.MetricKind.GAUGE or "start_time" in p.interval:
                raise ValueError("a GAUGE point has an end time only")
            if ts.value_type != MetricDescriptor.ValueType.DOUBLE or "double_value" not in p.value:
                raise ValueError("the value is not the DOUBLE declared")
            key = (ts.metric.type, tuple(sorted(ts.metric.labels.items())), tuple(sorted(ts.resource.labels.items())))
            if key in seen:
                raise ValueError(f"{ts.metric.type} appears twice in one request")
            seen.add(key)
            when = p.interval.end_time.timestamp()
            last = self.series.get(key, [])
            if last and when < last[-1][0] + _MIN_GAP_S:
                raise ValueError(
                    "One or more points were written more frequently than the maximum sampling "
                    "period configured for the metric"
                )
            out.append((key, when, p.value.double_value))
        return out


@pytest.fixture
def fake():
    f = FakeMonitoring()
    yield f
    f.stop()


def _cluster(n: int = 2) -> Cluster:
    return Cluster(
        "c1", tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(n)), zone="us-central1-a", project="p1"
    )


def _row(node: Node, received: float, **kw) -> NodeRow:
    return NodeRow(node, NodeStatus.OK, t=received, received=received, interval_s=1.0, **kw)


def test_time_series_are_one_gauge_point_per_known_value_on_a_generic_node():
    c = _cluster()
    rows = [
        _row(c.nodes[0], 1000.5, cpu_util_pct=12.5, host_rx=1.0, host_tx=2.0),
        NodeRow(c.nodes[1], NodeStatus.UNREACHABLE, received=1000.5),
    ]
    series = time_series(rows, c, "p1")
    assert sorted(ts.metric.type for ts in series) == sorted(
        METRIC_PREFIX + m for m in ("cpu_util_pct", "host_rx_gbps", "host_tx_gbps", "data_gbps")
    )
    ts = series[0]
    assert dict(ts.resource.labels) == {
        "project_id": "p1",
        "location": "us-central1-a",
        "namespace": "c1",
        "node_id": "10.0.0.2",
    }
    assert dict(ts.metric.labels) == {"rank": "0"}
    assert ts.points[0].interval.end_time.timestamp() == pytest.approx(1000.5)
    assert {m: ts.points[0].value.double_value for m, ts in ((t.metric.type, t) for t in series)}[
        METRIC_PREFIX + "data_gbps"
    ] == 3.0
    assert set(GAUGES) >= {"gpu_util_mean_pct", "gpu_nic_rx_gbps", "data_gbps"}


def test_the_exporter_writes_new_rows_only_in_batches_of_200_that_the_api_accepts(fake):
    c = _cluster(20)  # 20 nodes x 13 gauges: 260 series, two requests
    full = dict(
        gpu_count=8,
        gpu_util_mean=90.0,
        gpu_util_min=80.0,
        gpu_mem_used_mib=1.0,
        gpu_mem_total_mib=2.0,
        gpu_power_w=700.0,
        gpu_temp_c=60.0,
        cpu_util_pct=5.0,
        host_rx=1.0,
        host_tx=1.0,
        gpu_rx=100.0,
        gpu_tx=100.0,
        gpu_slowest_rx=10.0,
        gpu_slowest_tx=10.0,
    )
    now = [time.time() - 60]
    exporter = CloudExporter(c, "p1", lambda: [_row(n, now[0], **full) for n in c.nodes], 1.0, endpoint=fake.endpoint)
    assert exporter.period_s == 10.0  # never faster than the API takes
    assert exporter.write_once() == 20 * len(GAUGES)
    assert fake.requests == 2 and not fake.refused
    assert exporter.write_once() == 0 and fake.requests == 2  # nothing new: nothing written
    now[0] += 10
    exporter.write_once()
    assert fake.requests == 4 and not fake.refused
    assert all(len(points) == 2 for points in fake.series.values())


def test_a_refused_write_is_logged_once_and_the_exporter_goes_on(fake, caplog):
    c = _cluster(1)
    t = [time.time()]
    exporter = CloudExporter(c, "p1", lambda: [_row(c.nodes[0], t[0], cpu_util_pct=1.0)], 1.0, endpoint=fake.endpoint)
    assert exporter.write_once() == 1
    t[0] += 1  # 1 s later: the API refuses a point this soon
    assert exporter.write_once() == 0
    t[0] += 0.5
    assert exporter.write_once() == 0
    assert len(fake.refused) == 2
    assert sum("Cloud Monitoring refused" in r.message for r in caplog.records) == 1


def test_launch_top_cloud_monitoring_writes_every_nodes_samples(fake):
    r = CliRunner().invoke(
        top,
        [
            "--local",
            "--nodes",
            "2",
            "--interval",
            "0.5",
            "--duration",
            "2.2",
            "--project",
            "p1",
            "--cloud-monitoring",
            "--monitoring-endpoint",
            fake.endpoint,
        ],
    )
    assert r.exit_code == 0, r.output
    assert not fake.refused
    nodes = {dict(k[2])["node_id"] + "/" + dict(k[1])["rank"] for k in fake.series}
    assert nodes == {"localhost/0", "localhost/1"}
    types = {k[0] for k in fake.series}
    assert METRIC_PREFIX + "cpu_util_pct" in types and METRIC_PREFIX + "data_gbps" in types
    assert "time series written to Cloud Monitoring (project p1)" in r.output


def test_cloud_monitoring_without_a_project_is_a_one_line_refusal(fake):
    r = CliRunner().invoke(
        top,
        ["--local", "--nodes", "1", "--duration", "1", "--cloud-monitoring", "--monitoring-endpoint", fake.endpoint],
    )
    assert r.exit_code == 2 and "--cloud-monitoring needs the project" in r.output, r.output
    assert local_cluster(1).project is None


@pytest.mark.parametrize(
    "spoil, why",
    [
        (lambda ts: setattr(ts.resource, "type", "global"), "is not a generic_node"),
        (lambda ts: setattr(ts.metric, "type", "gpufleet/top/cpu_util_pct"), "is not user-defined"),
        (lambda ts: ts.points.append(ts.points[0]), "exactly one per time series"),
        (lambda ts: setattr(ts.points[0].interval, "start_time", {"seconds": 1}), "end time only"),
    ],
)
def test_the_stand_in_refuses_what_the_api_refuses(fake, spoil, why):
    """So that the exporter's passing writes mean something."""
    import google.api_core.exceptions as gexc

    c = _cluster(1)
    (ts,) = time_series([_row(c.nodes[0], time.time(), cpu_util_pct=1.0)], c, "p1")
    spoil(ts)
    exporter = CloudExporter(c, "p1", list, 1.0, endpoint=fake.endpoint)
    with pytest.raises(gexc.InvalidArgument, match=why):
        exporter.client.create_time_series(name="projects/p1", time_series=[ts])
    with pytest.raises(gexc.InvalidArgument, match="1 to 200"):
        exporter.client.create_time_series(name="projects/p1", time_series=[ts] * 201)
