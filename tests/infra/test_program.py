"""The Pulumi program, run as Pulumi runs it (infra/__main__.py as __main__, config from
PULUMI_CONFIG) under pulumi.runtime.set_mocks(..., preview=True): what it declares, per family."""

from __future__ import annotations

import ipaddress
import json

import pulumi
import pytest
from click.testing import CliRunner

from gpufleet.catalog import lookup
from gpufleet.contracts import LABEL_CLUSTER, LABEL_NODE, NODE_KEYS, OUTPUT_KEYS, parse_stack_outputs
from infra.mocks import RecordingMocks
from infra.preview import preview_program
from launcher.cli.main import main as launch
from launcher.cluster.discovery import cluster_from_outputs
from tests.infra.conftest import BASE

# One machine type per family (plus the small A3 High, which is Spot/Flex only, and A2 Ultra,
# which bundles local SSDs): (machine type, networks, subnets, NICs, GPU MTU, stack config extras).
FAMILIES = {
    "a2-highgpu-8g": (1, 1, 1, None, {}),
    "a2-ultragpu-8g": (1, 1, 1, None, {}),
    "a3-highgpu-4g": (1, 1, 1, None, {"provisioning": "spot"}),
    "a3-highgpu-8g": (5, 5, 5, 8244, {}),
    "a3-edgegpu-8g": (5, 5, 5, 8244, {}),
    "a3-megagpu-8g": (9, 9, 9, 8244, {}),
    "a3-ultragpu-8g": (3, 10, 10, 8896, {}),
    "a4-highgpu-8g": (3, 10, 10, 8896, {}),
}
SIZES = (1, 2, 16)
CASES = [(m, n) for m in FAMILIES for n in SIZES]


def run(fleet, machine, nodes, **extra):
    return fleet(machineType=machine, nodes=nodes, **{**FAMILIES[machine][4], **extra})


@pytest.mark.parametrize("machine, nodes", CASES)
def test_counts_of_networks_subnets_instances_and_nics(fleet, machine, nodes):
    n_nets, n_subnets, n_nics, _, _ = FAMILIES[machine]
    p = run(fleet, machine, nodes)
    assert len(p.of_type("Network")) == n_nets
    assert len(p.of_type("Subnetwork")) == n_subnets
    instances = p.node_instances()
    assert [i.inputs["name"] for i in instances] == [f"dev-{k}" for k in range(nodes)]
    for inst in instances:
        nics = inst.inputs["networkInterfaces"]
        assert len(nics) == n_nics == lookup(machine).nic_count
        # Every NIC on its own subnet, none shared within an instance.
        assert len({nic["subnetwork"] for nic in nics}) == n_nics


@pytest.mark.parametrize("machine, nodes", CASES)
def test_mtu_and_nic_types_follow_the_catalog(fleet, machine, nodes):
    _, _, _, mtu, _ = FAMILIES[machine]
    p = run(fleet, machine, nodes)
    for net in p.of_type("Network"):
        assert net.inputs.get("mtu") == mtu
        assert net.inputs["autoCreateSubnetworks"] is False
    roles = [nic.role for nic in lookup(machine).nics]
    for inst in p.node_instances():
        types = [nic["nicType"] for nic in inst.inputs["networkInterfaces"]]
        assert types == ["MRDMA" if r == "rdma" else "GVNIC" for r in roles]


@pytest.mark.parametrize("machine, nodes", CASES)
def test_compact_placement_is_attached_to_every_instance_of_a_multi_node_fleet(fleet, machine, nodes):
    p = run(fleet, machine, nodes)
    policies = p.of_type("ResourcePolicy")
    instances = p.node_instances()
    if nodes == 1:
        assert policies == []
        assert all(i.inputs.get("resourcePolicies") is None for i in instances)
        assert p.outputs["placementPolicy"] is None
        return
    (policy,) = policies
    group = policy.inputs["groupPlacementPolicy"]
    assert group["collocation"] == "COLLOCATED" and group["vmCount"] == nodes
    assert "maxDistance" not in group
    link = f"projects/{BASE['gcp:project']}/regions/us-central1/resourcePolicies/dev-placement"
    assert [i.inputs["resourcePolicies"] for i in instances] == [link] * nodes
    assert p.outputs["placementPolicy"] == "dev-placement"


@pytest.mark.parametrize("machine, nodes", CASES)
def test_no_external_ip_and_nothing_open_to_the_internet_by_default(fleet, machine, nodes):
    p = run(fleet, machine, nodes)
    for inst in p.of_type("Instance"):  # the nodes and the controller VM
        assert all(not nic.get("accessConfigs") for nic in inst.inputs["networkInterfaces"])
    for fw in p.of_type("Firewall"):
        assert "0.0.0.0/0" not in fw.inputs["sourceRanges"]
    ssh = p.named("dev-ssh").inputs
    assert ssh["sourceRanges"] == ["35.235.240.0/20"]
    assert ssh["allows"] == [{"protocol": "tcp", "ports": ["22"]}]
    assert all(n["externalIp"] is None for n in p.outputs["nodes"])
    # No external IP: egress (packages, images) goes through Cloud NAT.
    assert len(p.of_type("RouterNat")) == 1


@pytest.mark.parametrize("machine, nodes", CASES)
def test_internal_firewall_covers_exactly_each_networks_own_subnets(fleet, machine, nodes):
    p = run(fleet, machine, nodes)
    subnet_cidrs = {s.inputs["network"]: [] for s in p.of_type("Subnetwork")}
    for s in p.of_type("Subnetwork"):
        subnet_cidrs[s.inputs["network"]].append(s.inputs["ipCidrRange"])
    internal = [f for f in p.of_type("Firewall") if f.name.endswith("-internal")]
    rdma = [n for n in p.of_type("Network") if n.inputs.get("networkProfile")]
    assert len(internal) == len(p.of_type("Network")) - len(rdma)
    for fw in internal:
        assert fw.inputs["sourceRanges"] == subnet_cidrs[fw.inputs["network"]]
        assert {a["protocol"] for a in fw.inputs["allows"]} == {"tcp", "udp", "icmp"}
        assert fw.inputs["targetTags"] == ["dev"]


@pytest.mark.parametrize("machine, nodes", CASES)
def test_labels_name_the_cluster_and_node_index(fleet, machine, nodes):
    p = run(fleet, machine, nodes, labels={"team": "research"})
    for k, inst in enumerate(p.node_instances()):
        assert inst.inputs["labels"] == {"team": "research", LABEL_CLUSTER: "dev", LABEL_NODE: str(k)}
        assert inst.inputs["metadata"]["enable-oslogin"] == "TRUE"
        assert inst.inputs["metadata"]["enable-guest-attributes"] == "TRUE"  # host keys after a restart
        assert inst.inputs["tags"] == ["dev"]


@pytest.mark.parametrize("machine, nodes", CASES)
def test_outputs_list_nodes_in_rank_order(fleet, machine, nodes):
    p = run(fleet, machine, nodes)
    out = p.outputs
    assert sorted(out) == sorted(OUTPUT_KEYS)
    assert (out["cluster"], out["project"], out["zone"], out["machineType"]) == (
        "dev",
        BASE["gcp:project"],
        "us-central1-a",
        machine,
    )
    assert [n["index"] for n in out["nodes"]] == list(range(nodes))
    assert [n["name"] for n in out["nodes"]] == [f"dev-{k}" for k in range(nodes)]
    host_subnet = ipaddress.ip_network(out["networks"][0]["cidrs"][0])
    ips = [n["internalIp"] for n in out["nodes"]]
    assert len(set(ips)) == nodes and all(ipaddress.ip_address(ip) in host_subnet for ip in ips)
    assert all(set(n) == {"name", "index", "internalIp", "externalIp", "zone"} == set(NODE_KEYS) for n in out["nodes"])
    assert sorted(n["name"] for n in out["networks"]) == sorted(n.inputs["name"] for n in p.of_type("Network"))
    assert out["networks"][0]["role"] == "host" and out["networks"][0]["name"] == "dev-net"
    assert out["checkpointBucket"] is None


@pytest.mark.parametrize(
    "machine, nodes, external", [("a3-megagpu-8g", 16, False), ("a2-highgpu-8g", 1, False), ("a4-highgpu-8g", 2, True)]
)
def test_the_exported_outputs_are_what_the_launcher_reads(fleet, tmp_path, machine, nodes, external):
    """The contract round-trips: the outputs infra exports, saved as `pulumi stack output --json`
    prints them, are read by the launcher's parser and by `launch hosts --outputs F --dry-run`
    with each node's index as its rank."""
    extra = {"externalIp": True, "sshSourceRanges": ["203.0.113.0/24"]} if external else {}
    out = run(fleet, machine, nodes, **extra).outputs
    parsed = parse_stack_outputs(json.loads(json.dumps(out)))
    assert (parsed.cluster, parsed.project, parsed.zone, parsed.machine_type) == (
        "dev",
        BASE["gcp:project"],
        "us-central1-a",
        machine,
    )
    assert [(n.index, n.name, n.internal_ip, n.external_ip, n.zone) for n in parsed.nodes] == [
        (k, f"dev-{k}", out["nodes"][k]["internalIp"], out["nodes"][k]["externalIp"], "us-central1-a")
        for k in range(nodes)
    ]
    assert all(bool(n.external_ip) == external for n in parsed.nodes)
    # The machine type infra exports is the catalog's: the launcher gets each node's GPU count.
    assert cluster_from_outputs(out).gpus_per_node == lookup(machine).gpu_count == 8

    path = tmp_path / "o.json"
    path.write_text(json.dumps(out))
    args = ["hosts", "--outputs", str(path), "--dry-run", *(["--external-ip"] if external else [])]
    r = CliRunner().invoke(launch, args)
    assert r.exit_code == 0, r.output
    host = "externalIp" if external else "internalIp"
    assert r.stdout.splitlines() == [
        f"{k}\t{n[host]}\t{n['internalIp']}\t{n['name']}" for k, n in enumerate(out["nodes"])
    ]


@pytest.mark.parametrize("machine", FAMILIES)
def test_every_instance_waits_for_its_subnets_nat_identity_and_policy(fleet, machine):
    # NICs, the policy and the service account are named by path, so the ordering is explicit.
    p = run(fleet, machine, 2)
    subnets = {s.name for s in p.of_type("Subnetwork")}
    (nat,) = p.of_type("RouterNat")
    (account,) = [a for a in p.of_type("Account") if a.name == "dev-nodes"]
    needed = subnets | {nat.name, account.name, "dev-placement"} | {g.name for g in p.of_type("IAMMember")}
    for inst in p.node_instances():
        assert needed <= set(inst.depends_on), needed - set(inst.depends_on)
        nic_subnets = {nic["subnetwork"].rsplit("/", 1)[1] for nic in inst.inputs["networkInterfaces"]}
        assert nic_subnets <= subnets
    for sub in p.of_type("Subnetwork"):
        net = sub.inputs["network"].rsplit("/", 1)[1]
        assert net in sub.depends_on


@pytest.mark.parametrize("machine", FAMILIES)
def test_boot_disk_local_ssds_and_image_come_from_the_catalog(fleet, machine):
    p = run(fleet, machine, 2)
    t = lookup(machine)
    for inst in p.node_instances():
        params = inst.inputs["bootDisk"]["initializeParams"]
        assert params["image"] == t.default_image
        assert params["type"] == ("hyperdisk-balanced" if t.family in ("a3-ultra", "a4") else "pd-ssd")
        # Bundled local SSDs are attached by GCE itself (skypilot sky/provision/gcp/constants.py
        # SSD_AUTO_ATTACH_MACHINE_TYPES).
        assert "scratchDisks" not in inst.inputs
        assert inst.inputs["machineType"] == machine and inst.inputs["zone"] == "us-central1-a"
        assert "guestAccelerators" not in inst.inputs
        script = inst.inputs["metadata"]["startup-script"]
        assert f"readonly MACHINE_TYPE={machine}" in script
        assert f"readonly LOCAL_SSD_COUNT={t.local_ssd_count}" in script


@pytest.mark.parametrize(
    "machine, subnets",
    [
        ("a2-highgpu-8g", ["dev-net-subnet"]),
        ("a3-highgpu-8g", ["dev-net-subnet"] + [f"dev-gpu-net-{k}-subnet" for k in range(1, 5)]),
        ("a3-megagpu-8g", ["dev-net-subnet"] + [f"dev-gpu-net-{k}-subnet" for k in range(1, 9)]),
        ("a4-highgpu-8g", ["dev-net-subnet", "dev-net-2-subnet"] + [f"dev-rdma-net-subnet-{j}" for j in range(8)]),
    ],
)
def test_nics_join_the_subnets_in_the_order_the_gpu_stack_expects(fleet, machine, subnets):
    p = run(fleet, machine, 2)
    by_name = {s.name: s for s in p.of_type("Subnetwork")}
    for inst in p.node_instances():
        names = [nic["subnetwork"].rsplit("/", 1)[1] for nic in inst.inputs["networkInterfaces"]]
        assert names == subnets
        for nic in inst.inputs["networkInterfaces"]:
            sub = by_name[nic["subnetwork"].rsplit("/", 1)[1]]
            assert nic["subnetwork"] == f"projects/{BASE['gcp:project']}/regions/us-central1/subnetworks/{sub.name}"


@pytest.mark.parametrize("machine", ["a3-ultragpu-8g", "a4-highgpu-8g"])
def test_rdma_families_get_a_roce_vpc_with_eight_subnets_one_per_mrdma_nic(fleet, machine):
    p = run(fleet, machine, 2)
    (rdma,) = [n for n in p.of_type("Network") if n.inputs.get("networkProfile")]
    assert (
        rdma.inputs["networkProfile"] == f"projects/{BASE['gcp:project']}/global/networkProfiles/us-central1-a-vpc-roce"
    )
    rdma_subnets = [s for s in p.of_type("Subnetwork") if s.inputs["network"].endswith("/dev-rdma-net")]
    assert len(rdma_subnets) == 8
    for inst in p.node_instances():
        mrdma = [nic for nic in inst.inputs["networkInterfaces"] if nic["nicType"] == "MRDMA"]
        assert [nic["subnetwork"].rsplit("/", 1)[1] for nic in mrdma] == [f"dev-rdma-net-subnet-{j}" for j in range(8)]
    # No firewall on the RoCE VPC (cluster-toolkit's a3ultra-vm.yaml / a4high-vm.yaml declare none).
    assert not any(f.inputs["network"].endswith("/dev-rdma-net") for f in p.of_type("Firewall"))


def test_standard_scheduling_terminates_on_maintenance_and_restarts(fleet):
    (inst, _) = fleet(machineType="a3-megagpu-8g", nodes=2).node_instances()
    assert inst.inputs["scheduling"] == {
        "provisioningModel": "STANDARD",
        "onHostMaintenance": "TERMINATE",
        "automaticRestart": True,
    }
    assert "reservationAffinity" not in inst.inputs


def test_spot_scheduling_is_preemptible_without_restart_and_stops_on_preemption(fleet):
    for inst in fleet(machineType="a3-megagpu-8g", nodes=2, provisioning="spot").node_instances():
        assert inst.inputs["scheduling"] == {
            "provisioningModel": "SPOT",
            "preemptible": True,
            "automaticRestart": False,
            "onHostMaintenance": "TERMINATE",
            "instanceTerminationAction": "STOP",
        }


def test_flex_start_scheduling_has_a_max_run_duration_and_no_reservation(fleet):
    flex = fleet(machineType="a3-ultragpu-8g", nodes=2, provisioning="flex-start", maxRunHours=48)
    for inst in flex.node_instances():
        s = inst.inputs["scheduling"]
        assert s["provisioningModel"] == "FLEX_START" and s["automaticRestart"] is False
        assert s["instanceTerminationAction"] == "DELETE" and s["maxRunDuration"] == {"seconds": 48 * 3600}
        assert inst.inputs["reservationAffinity"] == {"type": "NO_RESERVATION"}


@pytest.mark.parametrize("machine, model", [("a3-megagpu-8g", "STANDARD"), ("a4-highgpu-8g", "RESERVATION_BOUND")])
def test_a_reservation_binds_every_node_to_that_specific_reservation(fleet, machine, model):
    p = fleet(machineType=machine, nodes=2, reservation="my-res")
    assert p.of_type("ResourcePolicy") == []
    for inst in p.node_instances():
        assert inst.inputs["reservationAffinity"] == {
            "type": "SPECIFIC_RESERVATION",
            "specificReservation": {"key": "compute.googleapis.com/reservation-name", "values": ["my-res"]},
        }
        assert inst.inputs["scheduling"]["provisioningModel"] == model
        assert inst.inputs["scheduling"]["onHostMaintenance"] == "TERMINATE"


def test_max_distance_reaches_the_policy(fleet):
    (policy,) = fleet(machineType="a3-megagpu-8g", nodes=4, maxDistance=2).of_type("ResourcePolicy")
    assert policy.inputs["groupPlacementPolicy"]["maxDistance"] == 2


def test_external_ip_when_asked_only_on_the_host_nic(fleet):
    p = fleet(machineType="a3-highgpu-8g", nodes=2, externalIp=True, sshSourceRanges=["203.0.113.0/24"])
    for inst in p.of_type("Instance"):  # the nodes and the controller VM
        nics = inst.inputs["networkInterfaces"]
        assert nics[0]["accessConfigs"] == [{"networkTier": "PREMIUM"}]
        assert all(not nic.get("accessConfigs") for nic in nics[1:])
    assert all(n["externalIp"] for n in p.outputs["nodes"])
    assert p.named("dev-ssh").inputs["sourceRanges"] == ["203.0.113.0/24"]
    assert p.of_type("RouterNat") == []


def test_created_service_account_gets_only_the_node_roles(fleet):
    p = fleet(machineType="a2-highgpu-8g", nodes=2)
    (account,) = [a for a in p.of_type("Account") if a.name == "dev-nodes"]
    email = f"{account.inputs['accountId']}@{BASE['gcp:project']}.iam.gserviceaccount.com"
    grants = p.of_type("IAMMember")
    # On the project: logs and metrics, no more (Artifact Registry is read per repository).
    assert sorted(g.inputs["role"] for g in grants) == [
        "roles/logging.logWriter",
        "roles/monitoring.metricWriter",
    ]
    assert all(g.inputs["member"] == f"serviceAccount:{email}" for g in grants)
    assert all(i.inputs["serviceAccount"]["email"] == email for i in p.node_instances())


def test_checkpoint_bucket_is_private_and_granted_to_the_nodes_alone(fleet):
    p = fleet(
        machineType="a2-highgpu-8g",
        nodes=2,
        checkpointBucket="gpufleet-test-ckpts",
        serviceAccount="trainer@gpufleet-test.iam.gserviceaccount.com",
    )
    (bucket,) = p.of_type("Bucket")
    assert bucket.inputs["name"] == "gpufleet-test-ckpts" and bucket.inputs["location"] == "US-CENTRAL1"
    assert bucket.inputs["uniformBucketLevelAccess"] is True and bucket.inputs["publicAccessPrevention"] == "enforced"
    grant = p.named("dev-nodes-checkpoints")
    assert grant.inputs == {
        "bucket": "gpufleet-test-ckpts",
        "role": "roles/storage.objectUser",
        "member": "serviceAccount:trainer@gpufleet-test.iam.gserviceaccount.com",
    }
    # A given service account is used as is: none created for the nodes (the controller VM has
    # its own), no project-wide grants.
    assert [a.name for a in p.of_type("Account")] == ["dev-controller"] and p.of_type("IAMMember") == []
    assert p.outputs["checkpointBucket"] == "gpufleet-test-ckpts"


BAD = [
    ({"gpufleet:machineType": "a3-mega"}, "gpufleet:machineType", "a3-megagpu-8g"),
    ({"gpufleet:nodes": "0"}, "gpufleet:nodes", "'0'"),
    ({"gpufleet:nodes": "1501"}, "gpufleet:nodes", "at most 1500"),
    ({"gpufleet:provisioning": "spot", "gpufleet:reservation": "r1"}, "gpufleet:reservation", "spot"),
    ({"gpufleet:machineType": "a3-highgpu-2g", "gpufleet:nodes": "1"}, "gpufleet:provisioning", "spot, flex-start"),
    ({"gpufleet:sshSourceRanges": '["10.0.0.1/8"]'}, "gpufleet:sshSourceRanges", "10.0.0.1/8"),
    ({"gpufleet:checkpointBucket": "goog-ckpts"}, "gpufleet:checkpointBucket", "goog-ckpts"),
    ({"gpufleet:externalIp": "yes"}, "gpufleet:externalIp", "true or false"),
]


@pytest.mark.parametrize("config, key, detail", BAD)
def test_bad_config_fails_with_one_line_before_any_resource_is_declared(config, key, detail):
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError) as e:
        preview_program({**BASE, **config}, mocks=mocks)
    message = str(e.value)
    assert "\n" not in message and key in message and detail in message
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained traceback
    assert mocks.declared == []


def test_service_account_ids_stay_unique_and_within_iam_limits():
    import re

    from infra.identity import service_account_id

    assert service_account_id("dev") == "dev-nodes"
    assert service_account_id("a" * 24) == "a" * 24 + "-nodes"  # up to 24 characters: as before
    long_a, long_b = "research-cluster-west-team-a", "research-cluster-west-team-b"
    ids = {service_account_id(n) for n in (long_a, long_b, "x" * 40, "ab-" * 13 + "a")}
    assert len(ids) == 4
    for account in ids | {service_account_id("abcdef")}:
        assert re.fullmatch(r"[a-z][-a-z0-9]{4,28}[a-z0-9]", account), account
    assert service_account_id(long_a).startswith("research-cluster-nodes-")


def test_clusters_sharing_a_long_prefix_get_their_own_service_accounts(fleet):
    names = ["research-cluster-west-team-a", "research-cluster-west-team-b"]
    accounts = [
        a
        for n in names
        for a in fleet(name=n, machineType="a2-highgpu-8g", nodes=1).of_type("Account")
        if a.name == f"{n}-nodes"
    ]
    assert len(accounts) == 2
    assert accounts[0].inputs["accountId"] != accounts[1].inputs["accountId"]


# ---- Artifact Registry: the jobs' images and PyPI, read by the nodes alone ---------------------------


def test_the_registries_are_declared_in_the_region_and_read_by_the_nodes_alone(fleet):
    from infra.registries import API, READER_ROLE

    p = fleet(machineType="a3-megagpu-8g", nodes=2, containerImage="us-central1-docker.pkg.dev/p/r/train:v1")
    repos = {r.inputs["repositoryId"]: r.inputs for r in p.of_type("gcp:artifactregistry/repository:Repository")}
    assert set(repos) == {"dev-images", "dev-pypi"}
    assert (repos["dev-images"]["format"], repos["dev-images"]["mode"]) == ("DOCKER", "STANDARD_REPOSITORY")
    assert (repos["dev-pypi"]["format"], repos["dev-pypi"]["mode"]) == ("PYTHON", "REMOTE_REPOSITORY")
    assert repos["dev-pypi"]["remoteRepositoryConfig"]["pythonRepository"] == {"publicRepository": "PYPI"}
    assert all(r["location"] == "us-central1" and r["labels"]["gpufleet-cluster"] == "dev" for r in repos.values())
    (api,) = p.of_type("gcp:projects/service:Service")
    assert api.inputs["service"] == API and api.inputs["disableOnDestroy"] is False
    assert all(api.name in r.depends_on for r in p.of_type("gcp:artifactregistry/repository:Repository"))
    email = f"dev-nodes@{BASE['gcp:project']}.iam.gserviceaccount.com"
    readers = p.of_type("RepositoryIamMember")
    assert sorted((g.inputs["repository"], g.inputs["role"], g.inputs["member"]) for g in readers) == [
        (repo, READER_ROLE, f"serviceAccount:{email}") for repo in ("dev-images", "dev-pypi")
    ]
    # The nodes wait for their read grants, and their docker trusts the region's registry host.
    for inst in p.node_instances():
        assert {g.name for g in readers} <= set(inst.depends_on)
        assert (
            "readonly DOCKER_REGISTRIES=(us-docker.pkg.dev us-central1-docker.pkg.dev)"
            in (inst.inputs["metadata"]["startup-script"])
        )
    out = p.outputs
    assert out["packageIndex"] == f"https://us-central1-python.pkg.dev/{BASE['gcp:project']}/dev-pypi/simple/"
    assert out["imageRepository"] == f"us-central1-docker.pkg.dev/{BASE['gcp:project']}/dev-images"
    assert out["image"] == "us-central1-docker.pkg.dev/p/r/train:v1"


def test_package_index_false_drops_the_pypi_repository_and_its_output(fleet):
    p = fleet(machineType="a2-highgpu-8g", nodes=1, packageIndex=False)
    repos = [r.inputs["repositoryId"] for r in p.of_type("gcp:artifactregistry/repository:Repository")]
    assert repos == ["dev-images"] and len(p.of_type("RepositoryIamMember")) == 1
    assert p.outputs["packageIndex"] is None and p.outputs["image"] is None
    # A2 pulls no GPUDirect image: only the stack's own registry host.
    script = p.node_instances()[0].inputs["metadata"]["startup-script"]
    assert "readonly DOCKER_REGISTRIES=(us-central1-docker.pkg.dev)" in script


def test_a_domain_scoped_project_is_a_path_in_the_registry_urls():
    from infra.registries import docker_repository_url, package_index_url

    assert (
        docker_repository_url("c", "example.com:proj", "us-east4")
        == "us-east4-docker.pkg.dev/example.com/proj/c-images"
    )
    assert package_index_url("c", "example.com:proj", "us-east4") == (
        "https://us-east4-python.pkg.dev/example.com/proj/c-pypi/simple/"
    )


def test_pulumi_up_warns_when_ssh_is_open_to_the_internet(caplog):
    """The program says it through pulumi.log.warn (without an engine, Python's logging)."""
    from infra.preview import preview_program

    config = {**BASE, "gpufleet:machineType": "a2-highgpu-1g", "gpufleet:nodes": 1, "gpufleet:externalIp": True}
    preview_program({**config, "gpufleet:sshSourceRanges": ["0.0.0.0/0"]})
    assert "gpufleet:sshSourceRanges 0.0.0.0/0 with gpufleet:externalIp true opens SSH" in caplog.text
    caplog.clear()
    preview_program({**config, "gpufleet:sshSourceRanges": ["203.0.113.0/24"]})
    assert "opens SSH" not in caplog.text


# ---- what the nodes boot, and who may log in ---------------------------------------------------------


@pytest.mark.parametrize("machine", ["a3-highgpu-8g", "a3-megagpu-8g"])
def test_the_boot_image_is_an_output_the_launcher_reads_and_cos_gets_a_pinned_default_image(fleet, machine):
    from gpufleet.catalog import COS_DEFAULT_CONTAINER_IMAGE

    out = run(fleet, machine, 2).outputs
    image = lookup(machine).default_image
    parsed = parse_stack_outputs(json.loads(json.dumps(out)))
    assert parsed.boot_image is not None and parsed.boot_image.image == image
    assert parsed.boot_image.family == image.rsplit("/", 1)[1]
    cluster = cluster_from_outputs(out)
    if machine == "a3-highgpu-8g":  # COS: no Python for the job, so a PyTorch image pinned by digest
        assert (parsed.boot_image.os, out["image"], cluster.boot_os) == ("cos", COS_DEFAULT_CONTAINER_IMAGE, "cos")
    else:
        assert (parsed.boot_image.os, out["image"], cluster.boot_os) == ("ubuntu", None, "ubuntu")


def test_users_get_os_login_and_the_iap_tunnel_on_each_vm_and_account_user_on_their_accounts(fleet):
    users = ["user:ana@example.com", "group:ml@example.com"]
    p = fleet(machineType="a3-megagpu-8g", nodes=2, users=users)
    vms = {"dev-0", "dev-1", "dev-controller"}
    logins = [g.inputs for g in p.of_type("InstanceIAMMember") if g.inputs["role"] == "roles/compute.osLogin"]
    tunnels = [g.inputs for g in p.of_type("TunnelInstanceIAMMember")]
    accounts = [g.inputs for g in p.of_type("gcp:serviceaccount/iAMMember:IAMMember")]
    for member in users:
        assert {g["instanceName"] for g in logins if g["member"] == member} == vms
        assert {g["instance"] for g in tunnels if g["member"] == member} == vms
        assert all(g["role"] == "roles/iap.tunnelResourceAccessor" for g in tunnels)
        assert {g["serviceAccountId"].rsplit("/", 1)[1].split("@")[0] for g in accounts if g["member"] == member} == {
            "dev-nodes",
            "dev-controller",
        }
    assert all(g["role"] == "roles/iam.serviceAccountUser" for g in accounts)
    # Least privilege: nothing for them on the project, and never the admin (sudo) login role.
    project_members = {g.inputs["member"] for g in p.of_type("gcp:projects/iAMMember:IAMMember")}
    assert not project_members & set(users)
    assert not [d for d in p.declared if (d.inputs or {}).get("role") == "roles/compute.osAdminLogin"]
    # Without gpufleet:users, no login grant at all.
    bare = fleet(machineType="a3-megagpu-8g", nodes=2)
    assert not bare.of_type("TunnelInstanceIAMMember")
    assert not [g for g in bare.of_type("InstanceIAMMember") if g.inputs["role"] == "roles/compute.osLogin"]
