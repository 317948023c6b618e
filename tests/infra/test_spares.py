"""gpufleet:spares under Pulumi's mocks: K more node VMs after gpufleet:nodes, in the compact
placement with the others, and the `spares` output the launcher reads as --spares' default."""

from __future__ import annotations

import json

import pulumi
import pytest

from gpufleet.contracts import parse_stack_outputs
from infra.mocks import RecordingMocks
from infra.preview import preview_program
from launcher.cluster.discovery import cluster_from_outputs
from tests.infra.conftest import BASE


def test_spares_add_k_node_vms_in_the_placement_and_are_exported(fleet):
    p = fleet(nodes=3, spares=1)
    assert [i.inputs["labels"]["gpufleet-node"] for i in p.node_instances()] == ["0", "1", "2", "3"]
    (policy,) = p.of_type("ResourcePolicy")
    assert policy.inputs["groupPlacementPolicy"]["vmCount"] == 4
    out = json.loads(json.dumps(p.outputs))
    assert out["spares"] == 1 and [n["index"] for n in out["nodes"]] == [0, 1, 2, 3]
    assert parse_stack_outputs(out).spares == 1 and cluster_from_outputs(out).spares == 1
    plain = json.loads(json.dumps(fleet(nodes=3).outputs))
    assert plain["spares"] == 0 and len(plain["nodes"]) == 3


def test_outputs_from_before_spares_read_as_none_and_a_bad_count_is_one_line():
    doc = {"nodes": [{"index": i, "internalIp": f"10.0.0.{i + 2}"} for i in range(2)]}
    assert parse_stack_outputs(doc).spares == 0
    for bad in (2, -1, "1", True):
        with pytest.raises(ValueError, match="'spares' is .* not a count from 0 to 1"):
            parse_stack_outputs({**doc, "spares": bad})


@pytest.mark.parametrize("value", ["-1", "x"])
def test_a_bad_spares_config_fails_with_one_line_before_any_resource(value):
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError) as e:
        preview_program({**BASE, "gpufleet:spares": value}, mocks=mocks)
    message = str(e.value)
    assert "\n" not in message and "gpufleet:spares" in message and "a whole number from 0" in message
    assert mocks.declared == []
