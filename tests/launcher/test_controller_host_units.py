"""The controller host (not a node) from each node source, and the refusals that need no network."""

from __future__ import annotations

import pytest

from gpufleet.contracts import controller_output, node_output, stack_outputs
from launcher.cli.options import find_cluster
from launcher.cluster.discovery import cluster_from_outputs, parse_hostfile
from launcher.cluster.key import authorize_entry
from launcher.core.types import Cluster, ControllerHost, Node, UserError
from launcher.jobs.node0 import job_host

NODES = (Node(0, "10.0.0.2", "10.0.0.2"), Node(1, "10.0.0.3", "10.0.0.3"))


def test_a_hostfile_controller_line_names_a_host_that_is_not_a_node():
    c = parse_hostfile("10.0.0.2\n# the controller:\ncontroller 10.0.0.9\n10.0.0.3 slots=2\n")
    assert [n.host for n in c.nodes] == ["10.0.0.2", "10.0.0.3"] and [n.rank for n in c.nodes] == [0, 1]
    assert c.controller == ControllerHost("10.0.0.9", "10.0.0.9")
    assert job_host(c) is c.controller
    # A host named "controller" stays a node; no line means node 0 keeps the role.
    plain = parse_hostfile("controller slots=2\n10.0.0.3\n")
    assert [n.host for n in plain.nodes] == ["controller", "10.0.0.3"] and plain.controller is None
    assert job_host(plain) is plain.nodes[0]
    assert parse_hostfile("controller\n").nodes[0].host == "controller"


@pytest.mark.parametrize(
    "text, words",
    [
        ("a\ncontroller b\ncontroller c\n", ["line 3", "one `controller HOST` line"]),
        ("a\ncontroller b c\n", ["line 2", "one host"]),
        ("a\ncontroller ;rm\n", ["line 2", "';rm' is not a valid host"]),
        ("a\ncontroller a\n", ["controller a is also node 0 (a)", "--controller HOST"]),
    ],
)
def test_a_bad_controller_line_is_one_line_naming_it(text, words):
    with pytest.raises(UserError) as e:
        parse_hostfile(text, source="hf")
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_a_controller_that_is_a_worker_by_address_is_refused():
    with pytest.raises(UserError, match=r"^controller gw is also node 1 \(10.0.0.3\)"):
        Cluster("c", NODES, controller=ControllerHost("gw", "10.0.0.3"))


def test_the_stack_outputs_controller_is_the_controller_host_internal_unless_asked_external():
    outputs = stack_outputs(
        cluster="dev",
        project="p",
        zone="z",
        machine_type="a3-highgpu-8g",
        nodes=[
            node_output(name=f"dev-{i}", index=i, internal_ip=f"10.0.0.{i + 2}", external_ip=None, zone="z")
            for i in range(2)
        ],
        placement_policy=None,
        networks=[],
        checkpoint_bucket=None,
        controller=controller_output(
            name="dev-controller", internal_ip="10.0.0.200", external_ip="203.0.113.9", zone="z"
        ),
    )
    c = cluster_from_outputs(outputs)
    assert c.controller == ControllerHost("10.0.0.200", "10.0.0.200", "dev-controller")
    assert cluster_from_outputs(outputs, prefer_external=True).controller.host == "203.0.113.9"
    del outputs["controller"]
    assert cluster_from_outputs(outputs).controller is None


def test_the_controller_flag_wins_over_the_hostfile_line_and_survives_node_selection(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("10.0.0.2\n10.0.0.3\n10.0.0.4\ncontroller 10.0.0.9\n")
    o = {"hostfile": hf, "exclude": "10.0.0.2", "nodes": 1}
    assert find_cluster(o).controller.host == "10.0.0.9"
    c = find_cluster({**o, "controller": "root@10.0.0.8"})
    assert c.controller == ControllerHost("root@10.0.0.8", "10.0.0.8") and [n.host for n in c.nodes] == ["10.0.0.3"]
    with pytest.raises(UserError, match="--controller does not apply to --local"):
        find_cluster({"local": True, "nodes": 2, "controller": "10.0.0.9"})


def test_the_cluster_key_is_authorized_from_the_controller_host_too():
    auth = authorize_entry("ssh-ed25519 AAAAC3Nz c", Cluster("c", NODES, controller=ControllerHost("gw", "10.0.0.9")))
    assert auth.startswith('from="10.0.0.2,10.0.0.3,10.0.0.9",')


def test_min_nodes_needs_recover_and_at_least_one_node():
    from launcher.jobs.recovery import RecoverRequest, recover_policy

    argv = ("--checkpoint-dir", "d")
    with pytest.raises(UserError, match="^--min-nodes needs --recover"):
        recover_policy(RecoverRequest(min_nodes=2), argv, detach=True)
    with pytest.raises(UserError, match="^--min-nodes 0 must be at least 1"):
        recover_policy(RecoverRequest(recover=True, min_nodes=0), argv, detach=True)
    assert recover_policy(RecoverRequest(recover=True, min_nodes=2), argv, detach=True).min_nodes == 2
    assert recover_policy(RecoverRequest(recover=True), argv, detach=True).min_nodes is None


def test_a_shrinking_recovery_says_how_many_nodes_it_went_on_with():
    from launcher.jobs.recovery import Recovery, recovery_lines

    (line,) = recovery_lines([Recovery(0.0, 2, "unreachable (connection lost)", 20, 5.2, shrunk_to=2).to_json()])
    assert line.endswith(
        "node 2 at step 20: unreachable (connection lost); relaunched after 5.2 s; went on with 2 nodes (--min-nodes)"
    )
