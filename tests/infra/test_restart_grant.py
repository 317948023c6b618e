"""--recover may start the cluster's stopped Spot VMs: the nodes' service account gets
compute.instances.get and compute.instances.start on the cluster's own instances, through a custom
role bound on each instance, and nothing broader (Pulumi's mocks, preview=True)."""

from __future__ import annotations

from infra.identity import NODE_ROLES
from infra.restart_grant import RESTART_PERMISSIONS, restart_role_id
from tests.infra.conftest import BASE

PROJECT = BASE["gcp:project"]


def _bindings(p):
    """The nodes' own bindings (the controller VM's account gets its own: tests/infra/test_controller.py)."""
    nodes = [b for b in p.of_type("InstanceIAMMember") if not b.name.endswith("-controller-restart")]
    return sorted(nodes, key=lambda b: b.inputs["instanceName"])


def test_the_nodes_may_get_and_start_their_own_instances_and_nothing_more(fleet):
    p = fleet(machineType="a3-highgpu-4g", provisioning="spot", nodes=3)
    (role,) = p.of_type("IAMCustomRole")
    assert sorted(role.inputs["permissions"]) == [
        "compute.instances.get",
        "compute.instances.getGuestAttributes",
        "compute.instances.start",
    ]
    assert role.inputs["roleId"] == restart_role_id("dev") and role.inputs["project"] == PROJECT
    (account,) = [a for a in p.of_type("Account") if a.name == "dev-nodes"]
    member = f"serviceAccount:{account.inputs['accountId']}@{PROJECT}.iam.gserviceaccount.com"
    bindings = _bindings(p)
    zones = {i.inputs["name"]: i.inputs["zone"] for i in p.node_instances()}
    assert [b.inputs["instanceName"] for b in bindings] == ["dev-0", "dev-1", "dev-2"] == sorted(zones)
    for b in bindings:
        assert b.inputs == {
            "project": PROJECT,
            "zone": zones[b.inputs["instanceName"]],
            "instanceName": b.inputs["instanceName"],
            "role": f"projects/{PROJECT}/roles/{restart_role_id('dev')}",
            "member": member,
        }
        assert b.inputs["instanceName"] in b.depends_on and role.name in b.depends_on
    # Nothing on the project: its grants are the node roles alone, none of them the restart role.
    assert sorted(g.inputs["role"] for g in p.of_type("IAMMember")) == sorted(NODE_ROLES)
    assert not p.of_type("IAMBinding") and not p.of_type("IAMPolicy") and not p.of_type("InstanceIAMBinding")


def test_a_given_service_account_gets_the_same_instance_level_grant(fleet):
    email = "trainer@gpufleet-test.iam.gserviceaccount.com"
    p = fleet(machineType="a2-highgpu-8g", nodes=2, serviceAccount=email)
    assert {b.inputs["member"] for b in _bindings(p)} == {f"serviceAccount:{email}"}
    assert len(_bindings(p)) == 2 and p.of_type("IAMMember") == []


def test_role_ids_are_valid_and_one_per_cluster():
    import re

    assert RESTART_PERMISSIONS == (
        "compute.instances.get",
        "compute.instances.start",
        "compute.instances.getGuestAttributes",
    )
    assert restart_role_id("dev") == "gpufleet_dev_restart"
    long_a, long_b = "research-cluster-" + "a" * 60, "research-cluster-" + "a" * 59 + "b"
    for rid in (restart_role_id("a-b.c"), restart_role_id(long_a), restart_role_id(long_b)):
        assert re.fullmatch(r"[a-zA-Z0-9_.]{3,64}", rid), rid
    assert restart_role_id(long_a) != restart_role_id(long_b)
