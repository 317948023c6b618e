"""`python -m infra.preview`: what `pulumi up` would create for a stack file, offline, and the
stack outputs it writes for `launch ... --outputs FILE --dry-run`."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pulumi
import pytest

from gpufleet.catalog import lookup
from gpufleet.contracts import OUTPUT_KEYS
from infra import config as infra_config
from infra.mocks import run_under_mocks
from infra.preview import NOTE_KEY, OUTPUTS_NOTE, main, preview_program
from infra.restart_grant import restart_role_id
from tests.infra.conftest import BASE
from tests.launcher import dry_runs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "Pulumi.example.yaml"

# One stack file per family, and what its preview must show:
# (nodes, networks, NIC types in order, MTU, provisioning model, termination action, placement
#  policy, service account created, reservation)
FAMILY_FILES = {
    "Pulumi.example.yaml": (2, 9, ["GVNIC"] * 9, 8244, "STANDARD", None, "llm-dev-placement", True, None),
    "examples/Pulumi.a2.yaml": (2, 1, ["GVNIC"], 1460, "SPOT", "STOP", "a2-spot-placement", True, None),
    "examples/Pulumi.a3-high.yaml": (4, 5, ["GVNIC"] * 5, 8244, "STANDARD", None, "a3-high-placement", True, None),
    "examples/Pulumi.a3-mega.yaml": (
        2,
        9,
        ["GVNIC"] * 9,
        8244,
        "FLEX_START",
        "DELETE",
        "a3-mega-flex-placement",
        False,
        None,
    ),
    "examples/Pulumi.a4.yaml": (
        2,
        3,
        ["GVNIC"] * 2 + ["MRDMA"] * 8,
        8896,
        "RESERVATION_BOUND",
        None,
        None,
        True,
        "my-a4-reservation",
    ),
}


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_family_has_an_example_stack_file_the_config_check_accepts():
    families = {infra_config.read_stack_file(str(ROOT / f)).machine.family for f in FAMILY_FILES}
    assert {"a2", "a3-high", "a3-mega"} <= families and families & {"a3-ultra", "a4"}


@pytest.mark.parametrize("name", FAMILY_FILES)
def test_json_shows_what_pulumi_up_would_create_for_each_family(capsys, name):
    nodes, n_nets, nic_types, mtu, model, term, policy, created, reservation = FAMILY_FILES[name]
    spec = infra_config.read_stack_file(str(ROOT / name))
    rc, out, err = run_main(capsys, str(ROOT / name), "--json")
    assert rc == 0, err
    s = json.loads(out)  # stdout holds the JSON document and nothing else
    counts = {r["type"]: r["count"] for r in s["resources"]}
    assert counts["gcp:compute/instance:Instance"] == nodes + 1  # the nodes and the controller VM
    assert counts["gcp:compute/network:Network"] == n_nets
    assert counts.get("gcp:compute/resourcePolicy:ResourcePolicy", 0) == (1 if policy else 0)
    assert {r["type"] for r in s["resources"] if r["component"]} <= {
        "gpufleet:infra:ControllerVm",
        "gpufleet:infra:GpuNetworks",
        "gpufleet:infra:NodeIdentity",
        "gpufleet:infra:NodePool",
        "gpufleet:infra:PlacementPolicy",
        "gpufleet:infra:Registries",
        "gpufleet:infra:RestartGrant",
    }
    assert [n["name"] for n in s["nodes"]] == [f"{spec.cluster}-{i}" for i in range(nodes)]
    assert len(s["networks"]) == n_nets and all(n["mtu"] == mtu for n in s["networks"])
    subnets = {sub["name"]: (n["name"], sub["cidr"]) for n in s["networks"] for sub in n["subnets"]}
    for i, node in enumerate(s["nodes"]):
        assert (node["index"], node["machineType"], node["zone"]) == (i, spec.machine_type, spec.zone)
        assert (
            [nic["nicType"] for nic in node["nics"]]
            == nic_types
            == ["MRDMA" if n.role == "rdma" else "GVNIC" for n in lookup(spec.machine_type).nics]
        )
        for nic in node["nics"]:
            assert subnets[nic["subnet"]] == (nic["network"], nic["cidr"]) and nic["mtu"] == mtu
        assert ipaddress.ip_address(node["internalIp"]) in ipaddress.ip_network(node["nics"][0]["cidr"])
        assert node["placementPolicy"] == policy and node["reservation"] == reservation
        sched = node["scheduling"]
        assert (sched["provisioningModel"], sched["onHostMaintenance"], sched["instanceTerminationAction"]) == (
            model,
            "TERMINATE",
            term,
        )
        assert node["labels"] == {**dict(spec.labels), "gpufleet-cluster": spec.cluster, "gpufleet-node": str(i)}
        assert node["serviceAccount"] == s["serviceAccount"]["email"]
    account = s["serviceAccount"]
    assert account["created"] is created
    assert account["projectRoles"] == (["roles/logging.logWriter", "roles/monitoring.metricWriter"] if created else [])
    if spec.checkpoint_bucket:
        assert account["bucketRoles"] == [{"bucket": spec.checkpoint_bucket, "role": "roles/storage.objectUser"}]
    # Every grant, for a given account too: the restart role on each node, the repositories, ...
    restart = f"projects/{spec.project}/roles/{restart_role_id(spec.cluster)}"
    repos = [f"{spec.cluster}-images"] + ([f"{spec.cluster}-pypi"] if spec.package_index else [])
    assert account["grants"] == sorted(
        [{"role": restart, "on": f"instance {spec.cluster}-{i}"} for i in range(nodes)]
        + [{"role": r, "on": f"project {spec.project}"} for r in account["projectRoles"]]
        + [{"role": b["role"], "on": f"bucket {b['bucket']}"} for b in account["bucketRoles"]]
        + [{"role": "roles/artifactregistry.reader", "on": f"repository {r}"} for r in repos],
        key=lambda g: (g["on"].split()[0] != "instance", g["on"], g["role"]),
    )
    assert [(r["name"], r["format"], r["mode"], r["readers"]) for r in s["registries"]] == [
        (repos[0], "DOCKER", "STANDARD_REPOSITORY", [f"serviceAccount:{account['email']}"])
    ] + (
        [(repos[1], "PYTHON", "REMOTE_REPOSITORY", [f"serviceAccount:{account['email']}"])]
        if spec.package_index
        else []
    )
    assert s["outputs"]["imageRepository"] == f"{spec.region}-docker.pkg.dev/{spec.project}/{repos[0]}"
    assert s["warnings"] == []
    ssh = [f for f in s["firewalls"] if f["allow"] == ["tcp:22"]]
    assert [f["sourceRanges"] for f in ssh] == [list(spec.ssh_source_ranges)]
    assert all("0.0.0.0/0" not in f["sourceRanges"] for f in s["firewalls"])
    assert sorted(s["outputs"]) == sorted(OUTPUT_KEYS)
    controller = s["controller"]
    assert (controller["name"], controller["machineType"], controller["zone"]) == (
        f"{spec.cluster}-controller",
        "e2-standard-2",
        spec.zone,
    )
    assert controller["provisioningModel"] == "STANDARD" and controller["preemptible"] is False
    assert [nic["subnet"] for nic in controller["nics"]] == [s["nodes"][0]["nics"][0]["subnet"]]
    assert controller["internalIp"] == s["outputs"]["controller"]["internalIp"]
    assert controller["cost"]["usdPerMonth"] == 48.92 and controller["cost"]["region"] == "us-central1"


def test_the_tables_show_resources_nodes_nics_account_and_firewalls(capsys):
    rc, out, err = run_main(capsys, str(EXAMPLE))
    assert rc == 0, err

    def row(*cells: str) -> re.Pattern[str]:
        return re.compile(r"│\s*" + r"\s*│\s*".join(re.escape(c) for c in cells) + r"\s*│")

    assert row("gcp:compute/instance:Instance", "3").search(out)
    assert row("gcp:compute/network:Network", "9").search(out)
    assert row("gcp:compute/subnetwork:Subnetwork", "9").search(out)
    assert row("gcp:compute/firewall:Firewall", "10").search(out)
    for i in range(2):
        assert row(
            str(i),
            f"llm-dev-{i}",
            "a3-megagpu-8g",
            "us-central1-a",
            f"10.0.0.{2 + i}",
            "llm-dev-placement",
            "STANDARD",
            "TERMINATE",
            "-",
        ).search(out), out
    assert "NICs: every node (llm-dev-0 … llm-dev-1)" in out
    assert row("nic0", "llm-dev-net", "llm-dev-net-subnet", "10.0.0.0/20", "GVNIC", "8244", "no").search(out)
    assert row("nic8", "llm-dev-gpu-net-8", "llm-dev-gpu-net-8-subnet", "10.8.0.0/20", "GVNIC", "8244", "no").search(
        out
    )
    assert row(
        "llm-dev-nodes@my-project-id.iam.gserviceaccount.com (created)",
        "projects/my-project-id/roles/gpufleet_llm_dev_restart",
        "each node's instance (2)",
    ).search(out)
    assert row("", "roles/logging.logWriter", "project my-project-id").search(out)
    assert row("", "roles/storage.objectUser", "bucket my-project-id-llm-dev-checkpoints").search(out)
    assert row("", "roles/artifactregistry.reader", "repository llm-dev-images, llm-dev-pypi").search(out)
    assert (
        "artifact registry llm-dev-pypi: remote repository of PYPI in us-central1, "
        "https://us-central1-python.pkg.dev/my-project-id/llm-dev-pypi/simple/" in out
    )
    assert "$0.10 per GB-month stored after the first 0.5 GB, nothing while empty" in out
    assert row("llm-dev-ssh", "llm-dev-net", "INGRESS", "tcp:22", "35.235.240.0/20", "llm-dev").search(out)
    assert "gpufleet-cluster=llm-dev, gpufleet-node=1, team=research" in out
    # The getting-started page's count of the example's resources is the preview's.
    (count,) = re.findall(
        r"The first prints the (\d+) Google Cloud resources", (ROOT / "docs" / "getting-started.md").read_text()
    )
    assert f"{count} Google Cloud resources, 7 gpufleet components" in out and count == "50"
    # The controller VM and what it costs: e2-standard-2, on-demand, $0.06701142/h x 730 h.
    assert row(
        "llm-dev-controller",
        "e2-standard-2",
        "us-central1-a",
        "10.0.15.253",
        "llm-dev-net-subnet",
        "no",
        "STANDARD",
        "MIGRATE",
        "$48.92",
    ).search(out), out
    assert "on-demand list price in us-central1: $0.0670/h x 730 h" in out
    account = "llm-dev-controller@my-project-id.iam.gserviceaccount.com (created)"
    role = "projects/my-project-id/roles/gpufleet_llm_dev_restart"
    assert row(account, role, "each node's instance (2)").search(out)
    # Nothing on the bucket for the controller: the launcher never touches it.
    assert not row("", "roles/storage.objectUser", "bucket my-project-id-llm-dev-checkpoints").search(
        out.split("Controller service account")[-1]
    )


def test_stack_name_reads_that_stack_file_in_the_current_directory(capsys, tmp_path, monkeypatch):
    (tmp_path / "Pulumi.research-7.yaml").write_text(
        "config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n  machineType: a2-highgpu-1g\n  nodes: 1\n"
    )
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_main(capsys, "--stack", "research-7", "--json")
    assert rc == 0, err
    s = json.loads(out)
    # No gpufleet:name: the stack name names the cluster, as `pulumi up --stack research-7` would.
    assert (s["stack"], s["cluster"], [n["name"] for n in s["nodes"]]) == ("research-7", "research-7", ["research-7-0"])
    assert s["nodes"][0]["placementPolicy"] is None


BAD_FILES = {
    "unknown key": "config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n  gpufleet:node: 2\n",
    "bad value": "config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n  gpufleet:nodes: two\n",
    "no project": "config:\n  gcp:zone: us-central1-a\n",
    "not yaml": "config: [\n",
    "secret": "config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n  gpufleet:name:\n    secure: AAE=\n",
}


@pytest.mark.parametrize("case", [*BAD_FILES, "missing file"])
def test_a_bad_stack_file_is_the_config_checks_one_line_and_exit_2(capsys, tmp_path, case):
    path = tmp_path / "Pulumi.dev.yaml"
    if case != "missing file":
        path.write_text(BAD_FILES[case])
    outputs = tmp_path / "o.json"
    outputs.write_text('{"kept": true}\n')
    assert infra_config.main([str(path)]) == 2
    expected = capsys.readouterr().err
    rc, out, err = run_main(capsys, str(path), "--outputs", str(outputs))
    assert (rc, out, err) == (2, "", expected)
    assert err.startswith("error: ") and err.count("\n") == 1
    # Nothing written: the old outputs file is untouched and no temporary file is left.
    assert outputs.read_text() == '{"kept": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["Pulumi.dev.yaml", "o.json"][case == "missing file" :])


def test_the_installed_command_and_the_config_check_print_the_same_line(tmp_path):
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(BAD_FILES["bad value"])
    check = subprocess.run([sys.executable, "-m", "infra.config", str(path)], capture_output=True, text=True, cwd=ROOT)
    preview = subprocess.run(
        [sys.executable, "-m", "infra.preview", str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert (preview.returncode, preview.stdout, preview.stderr) == (2, "", check.stderr)
    assert check.returncode == 2 and check.stderr == (
        "error: config gpufleet:nodes = 'two' is not allowed: a whole number from 1 to 4092 (e.g. 2)\n"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        ((), "give a stack file (Pulumi.<stack>.yaml) or --stack NAME, not both"),
        (
            ("Pulumi.example.yaml", "--stack", "example"),
            "give a stack file (Pulumi.<stack>.yaml) or --stack NAME, not both",
        ),
        (("Pulumi.example.yaml", "--jsn"), "No such option '--jsn'. Did you mean '--json'?"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = run_main(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_outputs_file_holds_the_stack_outputs_and_says_they_are_placeholders(capsys, tmp_path):
    target = tmp_path / "o.json"
    target.write_text("old")
    rc, out, err = run_main(capsys, str(EXAMPLE), "--outputs", str(target), "--json")
    assert rc == 0, err
    doc = json.loads(target.read_text())
    assert doc[NOTE_KEY] == OUTPUTS_NOTE and "placeholder" in OUTPUTS_NOTE
    assert sorted(k for k in doc if k != NOTE_KEY) == sorted(OUTPUT_KEYS)
    assert {k: doc[k] for k in OUTPUT_KEYS} == json.loads(out)["outputs"]
    assert [(n["name"], n["index"], n["internalIp"]) for n in doc["nodes"]] == [
        ("llm-dev-0", 0, "10.0.0.2"),
        ("llm-dev-1", 1, "10.0.0.3"),
    ]
    assert (doc["cluster"], doc["machineType"], doc["zone"]) == ("llm-dev", "a3-megagpu-8g", "us-central1-a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.json"]  # replaced whole, no temp file left
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as any file the user writes, not 0600
    assert f"wrote {target}" in err


@pytest.mark.parametrize("where", ["missing/o.json", "."])
def test_an_unwritable_outputs_path_is_one_line_before_the_preview_runs(capsys, tmp_path, where):
    target = tmp_path / where
    rc, out, err = run_main(capsys, str(EXAMPLE), "--outputs", str(target))
    assert rc == 2 and out == ""
    assert re.fullmatch(rf"error: outputs file {re.escape(repr(str(target)))} cannot be written: .+\n", err), err


def test_placeholder_addresses_follow_the_rank_every_run():
    config = {
        **BASE,
        "gpufleet:machineType": "a3-highgpu-8g",
        "gpufleet:nodes": "16",
        "gpufleet:externalIp": "true",
        "gpufleet:sshSourceRanges": '["198.51.100.0/24"]',
    }
    for _ in range(3):  # registrations reach the mocks in a different order from run to run
        nodes = preview_program(config).outputs["nodes"]
        assert [n["internalIp"] for n in nodes] == [f"10.0.0.{2 + i}" for i in range(16)]
        # External placeholders stay in the documentation range 203.0.113.0/24 (RFC 5737).
        assert [n["externalIp"] for n in nodes] == [f"203.0.113.{3 + i}" for i in range(16)]


def test_runs_in_one_process_do_not_see_each_others_exports():
    _, first = run_under_mocks(lambda: pulumi.export("a", 1))
    mocks, second = run_under_mocks(lambda: pulumi.export("b", 2))
    assert (first, second, mocks.declared) == ({"a": 1}, {"b": 2}, [])


def test_no_pulumi_runtime_internals_outside_the_sdk():
    # The review found _sync_await and _settings.SETTINGS.rpc_manager in the shipped package;
    # infra/mocks.py uses only pulumi.runtime's public API, and so must everything else.
    internals = re.compile(r"_sync_await|rpc_manager|pulumi\.runtime\.settings|pulumi\.runtime\.stack|_settings\.")
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for top in ("infra", "launcher", "gpufleet", "workloads", "tests", "bench")
        for p in (ROOT / top).rglob("*.py")
        if p != Path(__file__)
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if internals.search(line)
    ]
    assert found == []


@pytest.mark.slow
def test_from_a_stack_file_to_each_nodes_torchrun_line_offline(tmp_path):
    """docs/getting-started.md's offline step (the README's too), as a user runs it: two installed commands."""
    env = {**os.environ, "NO_COLOR": "1"}
    preview = subprocess.run(
        [sys.executable, "-m", "infra.preview", str(EXAMPLE), "--outputs", "o.json", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert preview.returncode == 0, preview.stderr
    json.loads(preview.stdout)  # a real process prints nothing else on stdout (no warnings, no status)
    launch = Path(sys.executable).with_name("launch")  # .venv/bin/launch, the console script
    dry = subprocess.run(
        [str(launch), "train", "--outputs", "o.json", "--dry-run=json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    lines, plans = dry_runs.remote_lines(dry.stdout), dry_runs.plans(dry.stdout)
    assert len(lines) == 2, dry.stdout
    for rank, (host, command) in enumerate(lines):
        ip = f"10.0.0.{2 + rank}"
        assert host == ip
        script = shlex.split(command)[-1]  # exec bash --norc --noprofile -c SCRIPT
        # The rank command the node runs (its plan, which the script hands its node program), with the
        # prepared environment's python, as a real launch runs it (not the node's python3).
        args = list(plans[rank].argv)
        assert script.endswith(" node " + shlex.quote(plans[rank].to_json()))
        assert re.fullmatch(r".*/\.gpufleet/envs/[0-9a-f]+/bin/python", args[0]) and args[1:3] == [
            "-m",
            "torch.distributed.run",
        ]
        torchrun = shlex.join(args)
        assert args[3:6] == ["--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=static"], torchrun
        assert "--master-addr=10.0.0.2" in args and "--master-port=29500" in args and f"--local-addr={ip}" in args
        assert f"--node-rank={rank}" in args and args[-2:] == ["-m", "workloads.train"]
        env = {v.name: v.value for v in plans[rank].env}
        assert (env["GPUFLEET_NODE_RANK"], env["GPUFLEET_NNODES"]) == (str(rank), "2")
        # a3-megagpu-8g: the TCPXO environment, with the host NIC for the control path.
        assert env["NCCL_FASTRAK_CTRL_DEV"] == "enp0s12" and env["NCCL_SOCKET_IFNAME"] == "enp0s12"


def test_an_existing_account_shows_every_grant_and_open_ssh_warns(capsys, tmp_path):
    """A given service account is used as is, but the program still binds roles to it: the preview
    lists each of them (never "(none granted here)"); SSH open to the internet warns at the top."""
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(
        "config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n  gpufleet:machineType: a2-highgpu-1g\n"
        "  gpufleet:nodes: 2\n  gpufleet:serviceAccount: trainer@my-project-id.iam.gserviceaccount.com\n"
        "  gpufleet:checkpointBucket: my-ckpts\n  gpufleet:externalIp: true\n"
        "  gpufleet:sshSourceRanges: ['0.0.0.0/0']\n  gpufleet:packageIndex: false\n"
    )
    rc, out, err = run_main(capsys, str(path))
    assert rc == 0, err
    assert "(none granted here)" not in out.split("Controller")[0]
    assert re.search(
        r"trainer@my-project-id\.iam\.gserviceaccount\.com \(existing: these grants are added to it\)\s*│\s*"
        r"projects/my-project-id/roles/gpufleet_dev_restart\s*│\s*each node's instance \(2\)",
        out,
    ), out
    assert re.search(r"│\s*roles/storage\.objectUser\s*│\s*bucket my-ckpts\s*│", out)
    assert re.search(r"│\s*roles/artifactregistry\.reader\s*│\s*repository dev-images\s*│", out)
    assert "dev-pypi" not in out  # packageIndex false: no PyPI repository
    first = out.splitlines()[1]
    assert first.startswith("warning: gpufleet:sshSourceRanges 0.0.0.0/0 with gpufleet:externalIp true opens SSH")
    rc, out, err = run_main(capsys, str(path), "--json")
    s = json.loads(out)
    assert s["warnings"] and s["outputs"]["packageIndex"] is None
    assert s["serviceAccount"]["created"] is False and len(s["serviceAccount"]["grants"]) == 4


def test_every_bad_key_is_its_own_line_in_the_preview_as_in_the_config_check(tmp_path):
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(
        "config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n"
        "  gpufleet:nodes: two\n  gpufleet:bootDiskSizeGb: big\n  gpufleet:externalIp: maybe\n"
    )
    check = subprocess.run([sys.executable, "-m", "infra.config", str(path)], capture_output=True, text=True, cwd=ROOT)
    preview = subprocess.run(
        [sys.executable, "-m", "infra.preview", str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert (check.returncode, check.stdout) == (2, "")
    assert (preview.returncode, preview.stdout, preview.stderr) == (2, "", check.stderr)
    assert check.stderr.splitlines() == [
        "error: config gpufleet:nodes = 'two' is not allowed: a whole number from 1 to 4092 (e.g. 2)",
        "error: config gpufleet:bootDiskSizeGb = 'big' is not allowed: a whole number from 50 to 65536 (e.g. 200)",
        "error: config gpufleet:externalIp = 'maybe' is not allowed: true or false",
    ]


def test_the_default_stack_prices_its_gpu_nodes_beside_the_controller_and_says_what_they_boot(capsys, tmp_path):
    from gpufleet.catalog import COS_DEFAULT_CONTAINER_IMAGE, HOURS_PER_MONTH, machine_price, on_demand_price

    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text("config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n")
    rc, out, _ = run_main(capsys, str(path), "--json")
    assert rc == 0
    s = json.loads(out)
    price = machine_price("a3-highgpu-8g")
    cost = s["nodeCost"]
    assert (cost["machineType"], cost["nodes"], cost["provisioning"], cost["region"]) == (
        "a3-highgpu-8g",
        2,
        "standard",
        price.region,
    )
    standard, spot = cost["models"]["standard"], cost["models"]["spot"]
    assert standard["usdPerHour"] == round(2 * price.on_demand_usd_per_hour, 2) == 176.98
    assert standard["usdPerMonth"] == round(2 * price.on_demand_usd_per_hour * HOURS_PER_MONTH, 2)
    assert spot["usdPerHour"] == round(2 * price.spot_usd_per_hour, 2)
    assert cost["models"]["flex-start"] is None  # the source has no Flex-start price: n/a, not a guess
    assert s["controller"]["cost"]["usdPerMonth"] == round(on_demand_price("e2-standard-2").usd_per_month, 2)
    assert s["bootImage"] == {
        "os": "cos",
        "image": "projects/cos-cloud/global/images/family/cos-105-lts",
        "family": "cos-105-lts",
    }
    assert s["containerImage"] == COS_DEFAULT_CONTAINER_IMAGE
    assert {n["bootDisk"]["os"] for n in s["nodes"]} == {"cos"}

    rc, out, _ = run_main(capsys, str(path))
    assert rc == 0
    assert re.search(r"│ 2 x a3-highgpu-8g\s+│ standard \(this stack\)\s+│\s+\$176\.98 │\s+\$129,195\.40 │", out), out
    assert re.search(r"│ 2 x a3-highgpu-8g\s+│ flex-start\s+│\s+n/a │\s+n/a │", out)
    assert re.search(r"│ controller e2-standard-2\s+│ standard\s+│\s+\$0\.0670 │\s+\$48\.92 │", out)
    boot = "nodes boot projects/cos-cloud/global/images/family/cos-105-lts (cos); jobs run in "
    assert f"{boot}{COS_DEFAULT_CONTAINER_IMAGE} unless" in out
    assert re.search(r"│ dev-0\s+│ projects/cos-cloud/global/images/family/cos-105-lts\s+│ cos\s+│", out)


def test_the_preview_lists_each_users_grants(capsys, tmp_path):
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(
        "config:\n  gcp:project: my-project-id\n  gcp:zone: us-central1-a\n  gpufleet:users: ['user:ana@example.com']\n"
    )
    rc, out, _ = run_main(capsys, str(path), "--json")
    assert rc == 0
    (user,) = json.loads(out)["users"]
    assert user["member"] == "user:ana@example.com"
    got = {(g["role"], g["on"]) for g in user["grants"]}
    assert ("roles/compute.osLogin", "instance dev-0") in got
    assert ("roles/iap.tunnelResourceAccessor", "instance dev-controller") in got
    assert ("roles/iam.serviceAccountUser", "service account dev-nodes@my-project-id.iam.gserviceaccount.com") in got
    assert len(got) == 3 * 2 + 2  # two roles on each of 3 VMs, one on each of 2 accounts
