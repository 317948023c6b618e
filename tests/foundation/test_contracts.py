"""gpufleet.contracts: the formats that cross package boundaries, written once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpufleet import contracts
from gpufleet.contracts import (
    CONTROLLER_KEYS,
    NODE_KEYS,
    OUTPUT_KEYS,
    OutputsError,
    StackController,
    StackNode,
    SweepRow,
    controller_output,
    is_error_line,
    node_output,
    parse_stack_outputs,
    stack_outputs,
    sweep_json_line,
)


def test_importing_the_contracts_imports_neither_pulumi_nor_torch_nor_click():
    code = (
        "import sys, gpufleet.contracts; "
        "print(sorted(m for m in ('pulumi', 'torch', 'click', 'infra', 'launcher') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _node(i: int, ip: str | None = None, **kw) -> dict:
    return {
        **node_output(
            name=f"n{i}", index=i, internal_ip=ip or f"10.0.0.{2 + i}", external_ip=None, zone="us-central1-a"
        ),
        **kw,
    }


CONTROLLER = controller_output(
    name="demo-controller", internal_ip="10.0.15.253", external_ip=None, zone="us-central1-a"
)


def _outputs(*indexes: int, controller: dict | None = CONTROLLER, **top) -> dict:
    return (
        stack_outputs(
            cluster="demo",
            project="proj-1",
            zone="us-central1-a",
            machine_type="a3-megagpu-8g",
            nodes=[_node(i) for i in indexes],
            placement_policy=None,
            networks=[],
            checkpoint_bucket=None,
            controller=controller,
        )
        | top
    )


def test_infras_builders_make_every_output_key_and_every_node_key_in_order():
    doc = _outputs(0, 1)
    assert tuple(doc) == OUTPUT_KEYS
    assert tuple(doc["nodes"][0]) == NODE_KEYS
    assert tuple(doc["controller"]) == CONTROLLER_KEYS
    # A stack without a controller VM exports no `controller` key at all.
    assert tuple(_outputs(0, 1, controller=None)) == tuple(k for k in OUTPUT_KEYS if k != "controller")
    assert doc["nodes"][1] == {
        "name": "n1",
        "index": 1,
        "internalIp": "10.0.0.3",
        "externalIp": None,
        "zone": "us-central1-a",
    }


def test_parsed_outputs_are_in_rank_order_and_other_keys_are_ignored():
    doc = _outputs(2, 0, 1, _preview="a note infra.preview adds")
    parsed = parse_stack_outputs(json.loads(json.dumps(doc)))
    assert [n.index for n in parsed.nodes] == [0, 1, 2]
    assert parsed.nodes[0] == StackNode(
        index=0, internal_ip="10.0.0.2", external_ip=None, name="n0", zone="us-central1-a"
    )
    assert (parsed.cluster, parsed.project, parsed.zone, parsed.machine_type) == (
        "demo",
        "proj-1",
        "us-central1-a",
        "a3-megagpu-8g",
    )


def test_a_hand_written_file_needs_only_index_and_internal_ip():
    parsed = parse_stack_outputs({"nodes": [{"index": 0, "internalIp": "10.0.0.2"}], "machineType": None})
    assert parsed.nodes == (StackNode(index=0, internal_ip="10.0.0.2"),)
    assert parsed.machine_type is None and parsed.cluster is None
    assert parsed.controller is None


def test_the_controller_is_read_beside_the_nodes():
    parsed = parse_stack_outputs(json.loads(json.dumps(_outputs(0, 1))))
    assert parsed.controller == StackController(
        name="demo-controller", internal_ip="10.0.15.253", external_ip=None, zone="us-central1-a"
    )
    assert [n.index for n in parsed.nodes] == [0, 1]  # the controller is not a node
    public = controller_output(name="c", internal_ip="10.0.15.253", external_ip="203.0.113.9", zone=None)
    assert parse_stack_outputs(_outputs(0, controller=public)).controller == StackController(
        name="c", internal_ip="10.0.15.253", external_ip="203.0.113.9"
    )


@pytest.mark.parametrize("doc", [_outputs(0, controller=None), _outputs(0, controller=None) | {"controller": None}])
def test_no_controller_key_or_null_is_a_stack_without_a_controller_vm(doc):
    parsed = parse_stack_outputs(doc)
    assert parsed.controller is None and len(parsed.nodes) == 1


@pytest.mark.parametrize(
    "controller, culprit",
    [
        ("10.0.15.253", "'controller' is str, not an object"),
        (["demo-controller"], "'controller' is list, not an object"),
        ({"internalIp": "10.0.15.253"}, "controller has no name"),
        ({"name": "", "internalIp": "10.0.15.253"}, "controller has no name ('')"),
        ({"name": "c"}, "controller has no internalIp"),
        ({"name": "c", "internalIp": 7}, "controller has no internalIp (7)"),
        ({"name": "c", "internalIp": "10.0.15.253", "externalIp": 7}, "controller.externalIp is 7, not a string"),
        ({"name": "c", "internalIp": "10.0.15.253", "zone": ["z"]}, "controller.zone is ['z'], not a string"),
        ({"name": "c", "internalIp": "10.0.0.3"}, "controller c has node 1's internalIp 10.0.0.3"),
    ],
)
def test_a_malformed_controller_is_one_line_naming_the_culprit(controller, culprit):
    with pytest.raises(OutputsError) as e:
        parse_stack_outputs(_outputs(0, 1, controller=controller))
    assert culprit in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("indexes, missing", [((0, 1, 3), 2), ((1, 2), 0), ((0, 2, 3, 5), 1), ((0, 5), 1)])
def test_a_gap_in_the_indexes_names_the_missing_index_and_the_fix(indexes, missing):
    with pytest.raises(OutputsError) as e:
        parse_stack_outputs(_outputs(*indexes))
    msg = str(e.value)
    assert f"node index {missing} is missing" in msg
    assert ", ".join(map(str, sorted(indexes))) in msg
    assert "pulumi up" in msg and "--hostfile" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "doc, culprit",
    [
        ([1, 2], "top level is list, not an object"),
        ({"cluster": "x"}, "'nodes' is missing"),
        ({"nodes": "10.0.0.1"}, "'nodes' is not a list"),
        ({"nodes": []}, "'nodes' is empty"),
        ({"nodes": ["10.0.0.1"]}, "nodes[0] is not an object"),
        ({"nodes": [{"index": 0}]}, "nodes[0] has no internalIp"),
        ({"nodes": [{"index": 0, "internalIp": ""}]}, "nodes[0] has no internalIp"),
        ({"nodes": [{"internalIp": "10.0.0.2"}]}, "nodes[0] has no index"),
        ({"nodes": [{"index": "0", "internalIp": "10.0.0.2"}]}, "nodes[0].index is '0', not an integer"),
        ({"nodes": [{"index": True, "internalIp": "10.0.0.2"}]}, "nodes[0].index is True, not an integer"),
        ({"nodes": [{"index": -1, "internalIp": "10.0.0.2"}]}, "nodes[0].index is -1"),
        (
            {"nodes": [{"index": 0, "internalIp": "10.0.0.2", "externalIp": 7}]},
            "nodes[0].externalIp is 7, not a string",
        ),
        ({"nodes": [{"index": 0, "internalIp": "10.0.0.2", "name": ["a"]}]}, "nodes[0].name is ['a'], not a string"),
        ({"nodes": [_node(0), _node(0, "10.0.0.9")]}, "node indexes repeat: [0, 0]"),
        ({"nodes": [_node(0)], "machineType": 8}, "machineType is 8, not a string"),
        ({"nodes": [_node(0)], "zone": {"z": 1}}, "zone is {'z': 1}, not a string"),
        ({"nodes": [_node(0)], "bootImage": "cos"}, "'bootImage' is str, not an object"),
        ({"nodes": [_node(0)], "bootImage": {"os": "windows", "image": "x"}}, "bootImage.os is 'windows'"),
        ({"nodes": [_node(0)], "bootImage": {"os": "cos"}}, "bootImage has no image"),
    ],
)
def test_bad_outputs_are_one_line_naming_the_culprit(doc, culprit):
    with pytest.raises(OutputsError) as e:
        parse_stack_outputs(doc)
    assert culprit in str(e.value)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_the_sweep_json_line_carries_rows_that_read_back():
    row = SweepRow("all_reduce", 8, 2, "float", "sum", -1, 2, 1.0, 2.0, 3.0, 0, 1.0, 2.0, 4.0, 0, iters=5)
    line = sweep_json_line({"version": contracts.SWEEP_JSON_VERSION, "rows": [row.__dict__]})
    assert line.startswith(contracts.JSON_MARKER) and line.startswith("#") and line.endswith("}\n")
    assert line.count("\n") == 1
    doc = json.loads(line[len(contracts.JSON_MARKER) :])
    assert doc["version"] == 1
    assert SweepRow.from_dict(doc["rows"][0]) == row
    assert SweepRow.from_dict({**doc["rows"][0], "a_newer_field": 1}) == row
    assert row.best_busbw == 4.0


@pytest.mark.parametrize(
    "line, own",
    [
        ("error: loss is NaN at step 3", True),
        ("sweep: root 5 is not a rank of this run", True),
        ("gpufleet: --workdir /x does not exist on n0", True),
        ("[rank0]: RuntimeError: error: something", False),
        ("errors: 3", False),
        ("  error: indented is a consequence, not the program's line", False),
    ],
)
def test_a_node_programs_own_error_line_is_known_by_its_prefix(line, own):
    assert is_error_line(line) is own


@pytest.mark.parametrize(
    "image, os_, family",
    [
        ("projects/cos-cloud/global/images/family/cos-105-lts", "cos", "cos-105-lts"),
        ("projects/cos-cloud/global/images/cos-105-17412-535-78", "cos", None),
        (
            "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accelerator-2404-amd64-with-nvidia-580",
            "ubuntu",
            "ubuntu-accelerator-2404-amd64-with-nvidia-580",
        ),
        ("projects/my-proj/global/images/my-tcpx-image", "ubuntu", None),
    ],
)
def test_the_boot_image_output_says_os_image_and_family_and_reads_back(image, os_, family):
    from gpufleet.contracts import BOOT_IMAGE_KEYS, StackBootImage, boot_image_output

    out = boot_image_output(image)
    assert tuple(out) == BOOT_IMAGE_KEYS and out == {"os": os_, "image": image, "family": family}
    doc = stack_outputs(
        cluster="demo",
        project="proj-1",
        zone="us-central1-a",
        machine_type="a3-highgpu-8g",
        nodes=[_node(0)],
        placement_policy=None,
        networks=[],
        checkpoint_bucket=None,
        boot_image=out,
    )
    assert parse_stack_outputs(json.loads(json.dumps(doc))).boot_image == StackBootImage(os_, image, family)


def test_outputs_written_before_boot_image_existed_still_read():
    doc = {"nodes": [_node(0)], "machineType": "a3-highgpu-8g"}
    assert parse_stack_outputs(doc).boot_image is None
    assert parse_stack_outputs({**doc, "bootImage": None}).boot_image is None
