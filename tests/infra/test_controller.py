"""The controller VM (Pulumi's mocks, preview=True): a small on-demand VM on the host subnet,
its own least-privilege service account, its startup script, and the `controller` stack output."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest

from gpufleet.catalog import ON_DEMAND_PRICES
from gpufleet.contracts import (
    CONTROLLER_KEYS,
    LABEL_CLUSTER,
    LABEL_CONTROLLER,
    LABEL_NODE,
    OUTPUT_KEYS,
    parse_stack_outputs,
)
from infra.controller import CONTROLLER_MACHINE_TYPE, controller_account_id
from infra.identity import BUCKET_ROLE, NODE_ROLES, service_account_id
from infra.restart_grant import restart_role_id
from infra.startup import COMPUTE_REQUIREMENT, render_controller_script
from tests.infra.conftest import BASE

PROJECT = BASE["gcp:project"]
ROLE = f"projects/{PROJECT}/roles/{restart_role_id('dev')}"
EMAIL = f"{controller_account_id('dev')}@{PROJECT}.iam.gserviceaccount.com"
MEMBER = f"serviceAccount:{EMAIL}"


def grants_of(p, member: str) -> list[tuple[str, str, str]]:
    """Every IAM grant to `member`, as (resource type, what it is on, role)."""
    found = []
    for g in p.of_type("InstanceIAMMember"):
        if g.inputs["member"] == member:
            found.append(("instance", g.inputs["instanceName"], g.inputs["role"]))
    for g in p.of_type("BucketIAMMember"):
        if g.inputs["member"] == member:
            found.append(("bucket", g.inputs["bucket"], g.inputs["role"]))
    for token in ("IAMMember", "IAMBinding", "IAMPolicy"):
        for g in p.of_type(f"gcp:projects/i{token[1:]}:{token}"):
            if member in (g.inputs.get("member"), *(g.inputs.get("members") or [])):
                found.append(("project", g.inputs["project"], g.inputs.get("role", "")))
    return sorted(found)


@pytest.mark.parametrize("machine", ["a2-highgpu-8g", "a3-megagpu-8g", "a4-highgpu-8g"])
def test_the_controller_vm_is_declared_by_default_on_the_host_subnet(fleet, machine):
    p = fleet(machineType=machine, nodes=2)
    vm = p.controller_instance()
    assert vm is not None and vm.inputs["name"] == "dev-controller"
    assert vm.inputs["machineType"] == CONTROLLER_MACHINE_TYPE == "e2-standard-2"
    assert vm.inputs["zone"] == "us-central1-a" and vm.inputs["project"] == PROJECT
    (nic,) = vm.inputs["networkInterfaces"]
    # The nodes' first NIC's subnet: the host VPC, whose firewall rules target the cluster's tag.
    assert nic["subnetwork"] == p.node_instances()[0].inputs["networkInterfaces"][0]["subnetwork"]
    assert nic["subnetwork"] == f"projects/{PROJECT}/regions/us-central1/subnetworks/dev-net-subnet"
    assert "accessConfigs" not in nic  # no external IP
    assert vm.inputs["tags"] == ["dev"]
    # Not a node: discovery by the cluster label must not list it, nor rank it.
    labels = vm.inputs["labels"]
    assert labels[LABEL_CONTROLLER] == "dev" and LABEL_CLUSTER not in labels and LABEL_NODE not in labels
    assert vm.inputs["serviceAccount"]["email"] == EMAIL
    assert vm.inputs["metadata"]["enable-oslogin"] == "TRUE"
    assert vm.inputs["metadata"]["enable-guest-attributes"] == "TRUE"  # host keys readable from the API
    # Created after its subnet and the NAT its first boot downloads through.
    (nat,) = p.of_type("RouterNat")
    assert {"dev-net-subnet", nat.name, "dev-controller"} <= set(vm.depends_on)


@pytest.mark.parametrize("provisioning", ["standard", "spot", "flex-start"])
def test_the_controller_is_on_demand_whatever_the_fleets_provisioning(fleet, provisioning):
    p = fleet(machineType="a3-megagpu-8g", nodes=2, provisioning=provisioning)
    assert p.controller_instance().inputs["scheduling"] == {
        "provisioningModel": "STANDARD",
        "preemptible": False,
        "automaticRestart": True,
        "onHostMaintenance": "MIGRATE",
    }
    assert "reservationAffinity" not in p.controller_instance().inputs
    if provisioning == "spot":
        assert all(n.inputs["scheduling"]["provisioningModel"] == "SPOT" for n in p.node_instances())


def test_an_external_ip_only_when_the_nodes_get_one(fleet):
    p = fleet(machineType="a3-highgpu-8g", nodes=2, externalIp=True, sshSourceRanges=["203.0.113.0/24"])
    (nic,) = p.controller_instance().inputs["networkInterfaces"]
    assert nic["accessConfigs"] == [{"networkTier": "PREMIUM"}]
    assert p.outputs["controller"]["externalIp"] and p.outputs["controller"]["externalIp"].startswith("203.0.113.")
    assert parse_stack_outputs(p.outputs).controller.external_ip == p.outputs["controller"]["externalIp"]


def test_its_account_may_start_the_fleets_own_instances_and_nothing_else(fleet):
    p = fleet(machineType="a3-highgpu-4g", provisioning="spot", nodes=3)
    (account,) = [a for a in p.of_type("Account") if a.name == "dev-controller"]
    assert account.inputs["accountId"] == controller_account_id("dev") == "dev-controller"
    # Per instance, the role --recover already uses; no bucket in this stack, no project role.
    assert grants_of(p, MEMBER) == [("instance", f"dev-{i}", ROLE) for i in range(3)]
    (role,) = p.of_type("IAMCustomRole")
    for b in p.of_type("InstanceIAMMember"):
        if b.inputs["member"] == MEMBER:
            assert b.inputs["zone"] == "us-central1-a" and b.inputs["project"] == PROJECT
            assert {b.inputs["instanceName"], role.name, account.name} <= set(b.depends_on)
    # The project's grants are the nodes' roles alone, to the nodes' account.
    nodes_member = f"serviceAccount:{service_account_id('dev')}@{PROJECT}.iam.gserviceaccount.com"
    assert sorted((g.inputs["member"], g.inputs["role"]) for g in p.of_type("IAMMember")) == sorted(
        (nodes_member, r) for r in NODE_ROLES
    )


def test_with_a_bucket_its_account_gets_nothing_on_it(fleet):
    """The launcher never reads or writes the checkpoint bucket (no storage client in launcher/):
    the nodes' jobs do, with the nodes' own grant. The controller gets none."""
    p = fleet(
        machineType="a2-highgpu-8g",
        nodes=2,
        checkpointBucket="gpufleet-test-ckpts",
        serviceAccount="trainer@gpufleet-test.iam.gserviceaccount.com",
    )
    assert grants_of(p, MEMBER) == [("instance", f"dev-{i}", ROLE) for i in range(2)]
    launcher = Path(__file__).parents[2] / "launcher"
    for path in launcher.rglob("*.py"):
        text = path.read_text()
        assert "google.cloud.storage" not in text and "gs://" not in text and "storage.googleapis" not in text, path
    # The given node account keeps its own grants.
    assert grants_of(p, "serviceAccount:trainer@gpufleet-test.iam.gserviceaccount.com") == sorted(
        [("bucket", "gpufleet-test-ckpts", BUCKET_ROLE)] + [("instance", f"dev-{i}", ROLE) for i in range(2)]
    )


@pytest.mark.parametrize("nodes", [1, 16])
def test_the_controller_is_exported_beside_the_nodes_and_read_back(fleet, nodes):
    p = fleet(machineType="a3-megagpu-8g", nodes=nodes)
    out = p.outputs
    assert sorted(out) == sorted(OUTPUT_KEYS)
    assert tuple(out["controller"]) == CONTROLLER_KEYS
    assert (out["controller"]["name"], out["controller"]["zone"], out["controller"]["externalIp"]) == (
        "dev-controller",
        "us-central1-a",
        None,
    )
    # Its placeholder address is in the host subnet and is no node's, whatever the arrival order.
    host = ipaddress.ip_network(out["networks"][0]["cidrs"][0])
    ip = out["controller"]["internalIp"]
    assert ipaddress.ip_address(ip) in host and ip == "10.0.15.253"
    assert ip not in {n["internalIp"] for n in out["nodes"]}
    parsed = parse_stack_outputs(json.loads(json.dumps(out)))
    assert parsed.controller.name == "dev-controller" and parsed.controller.internal_ip == ip
    assert len(parsed.nodes) == nodes


def test_turning_it_off_removes_the_vm_its_account_its_grants_and_the_output(fleet):
    on = fleet(machineType="a3-megagpu-8g", nodes=2, checkpointBucket="gpufleet-test-ckpts")
    off = fleet(machineType="a3-megagpu-8g", nodes=2, checkpointBucket="gpufleet-test-ckpts", controller=False)
    assert off.controller_instance() is None and off.of_type("ControllerVm") == []
    assert "controller" not in off.outputs and sorted(off.outputs) == sorted(set(OUTPUT_KEYS) - {"controller"})
    assert parse_stack_outputs(off.outputs).controller is None
    assert grants_of(off, MEMBER) == []
    assert [a.name for a in off.of_type("Account")] == ["dev-nodes"]
    # Exactly the controller's four resources go: VM, account, 2 instance grants.
    assert len([d for d in on.declared if d.custom]) - len([d for d in off.declared if d.custom]) == 4
    assert [n.inputs["name"] for n in off.node_instances()] == ["dev-0", "dev-1"]


def test_its_startup_script_is_the_rendered_controller_script_without_secrets(fleet):
    source = "git+https://github.com/me/gpufleet.git@v0.1.0"
    p = fleet(machineType="a2-highgpu-8g", nodes=1, controllerSource=source)
    script = p.controller_instance().inputs["metadata"]["startup-script"]
    assert script == render_controller_script(cluster="dev", source=source)
    assert f"readonly SOURCE={source}" in script
    # The nodes keep their own script; the controller's installs the launcher, no GPU stack.
    assert "nvidia-smi" not in script and "pip install" in script
    assert not re.search(r"(token|password|secret|BEGIN [A-Z ]*PRIVATE KEY)", script, re.I)


def test_without_a_source_its_script_installs_the_compute_client_alone(fleet):
    p = fleet(machineType="a2-highgpu-8g", nodes=1)
    script = p.controller_instance().inputs["metadata"]["startup-script"]
    assert script == render_controller_script(cluster="dev", source=None)
    assert "readonly SOURCE=''" in script and f"readonly REQUIREMENT='{COMPUTE_REQUIREMENT}'" in script


def test_controller_account_ids_stay_unique_and_within_iam_limits():
    assert controller_account_id("dev") == "dev-controller"
    assert controller_account_id("a") == "a-controller"  # 6-30 characters even for a 1-letter name
    long_a, long_b = "research-cluster-west-team-a", "research-cluster-west-team-b"
    ids = {controller_account_id(n) for n in (long_a, long_b, "x" * 40, "ab-" * 13 + "a", "a" * 19, "a" * 20)}
    assert len(ids) == 6
    for account in ids:
        assert re.fullmatch(r"[a-z][-a-z0-9]{4,28}[a-z0-9]", account), account
        assert not account.endswith("-nodes") and "-nodes-" not in account


def test_the_catalog_prices_the_controller_with_its_source():
    price = ON_DEMAND_PRICES[CONTROLLER_MACHINE_TYPE]
    assert (price.region, price.usd_per_hour) == ("us-central1", 0.06701142)
    assert round(price.usd_per_month, 2) == 48.92  # 730 h, Google's month
    assert "cloud.google.com/compute/vm-instance-pricing" in price.source and price.retrieved


def test_the_preview_prints_the_vm_and_its_monthly_cost_or_that_there_is_none(capsys, tmp_path):
    from infra.preview import main

    base = (
        "config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n  machineType: a2-highgpu-1g\n  nodes: 1\n"
    )
    (tmp_path / "Pulumi.on.yaml").write_text(base)
    (tmp_path / "Pulumi.off.yaml").write_text(base + "  controller: false\n")
    assert main([str(tmp_path / "Pulumi.on.yaml")]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"│\s*on-controller\s*│\s*e2-standard-2\s*│.*│\s*STANDARD\s*│\s*MIGRATE\s*│\s*\$48\.92\s*│", out
    ), out
    assert main([str(tmp_path / "Pulumi.off.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["controller"] is None
    assert main([str(tmp_path / "Pulumi.off.yaml")]) == 0
    out = capsys.readouterr().out
    assert "no controller VM (gpufleet:controller false)" in out and "e2-standard-2" not in out
