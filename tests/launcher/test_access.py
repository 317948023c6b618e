"""Getting in, as a newcomer meets it: IAP by itself when this machine is not in the nodes' VPC
(said once; --no-iap for a VPN), one line naming what a tunnel that cannot open lacks, and the
user name and key from OS Login (a fake of its API answering in Google's documented format,
tests/launcher/fake_oslogin.py; the metadata server faked from its documented format too)."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import options
from launcher.cli.main import main
from launcher.cluster import reach
from launcher.cluster.discovery import cluster_from_outputs
from launcher.core.types import SshConfig
from tests.launcher.fake_oslogin import FakeOsLogin, OsLoginUser

Z = "us-central1-a"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGq7b9p4R0f3Yw1XvJ7d0m8a2QmYJr4d0jv1WJmV2c1x alice@laptop"
OTHER = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBzj0Tq1n2p9F7Kc9b3bQkq8m8G0d5kq3wZQ2a7mYV3f other"


def _route_table(path: Path, *routes: tuple[str, str, str]) -> Path:
    """A /proc/net/route with (destination, gateway, mask) rows, little-endian hex as Linux writes it."""

    def hx(a: str) -> str:
        return f"{int.from_bytes(ipaddress.IPv4Address(a).packed, 'little'):08X}"

    head = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
    rows = "".join(f"eth0\t{hx(d)}\t{hx(g)}\t0003\t0\t0\t0\t{hx(m)}\t0\t0\t0\n" for d, g, m in routes)
    path.write_text(head + rows)
    return path


class _Metadata:
    """The metadata server's network-interfaces answer (predefined-metadata-keys), or nothing."""

    def __init__(self, interfaces: list[dict]):
        doc = json.dumps(interfaces).encode()
        self.asked: list[str] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                fake.asked.append(self.headers.get("Metadata-Flavor", ""))
                self.send_response(200)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(doc)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def off_their_vpc(tmp_path, monkeypatch):
    """A laptop: a default route only, and no metadata server (a port nothing listens on)."""
    monkeypatch.setattr(reach, "ROUTE_TABLE", _route_table(tmp_path / "route", ("0.0.0.0", "192.168.1.1", "0.0.0.0")))
    monkeypatch.setenv(reach.METADATA_HOST_ENV, "127.0.0.1:9")
    options._SAID.clear()


def _outputs(tmp_path: Path, external: bool = False) -> Path:
    nodes = [
        {
            "name": f"llm-dev-{i}",
            "index": i,
            "internalIp": f"10.128.0.{i + 2}",
            "externalIp": f"34.1.1.{i}" if external else None,
        }
        for i in range(2)
    ]
    f = tmp_path / "o.json"
    f.write_text(json.dumps({"cluster": "llm-dev", "project": "p", "zone": Z, "machineType": None, "nodes": nodes}))
    return f


def _cluster(tmp_path: Path, external: bool = False, prefer_external: bool = False):
    return cluster_from_outputs(json.loads(_outputs(tmp_path, external).read_text()), prefer_external=prefer_external)


# ---- is this machine in their VPC? ---------------------------------------------------------------


def test_a_route_other_than_the_default_one_reaches_the_nodes(tmp_path):
    table = _route_table(
        tmp_path / "route",
        ("0.0.0.0", "192.168.1.1", "0.0.0.0"),
        ("10.128.0.0", "0.0.0.0", "255.255.240.0"),  # a connected subnet, or a VPN's route
    )
    assert reach.routed_directly("10.128.0.2", table)
    assert not reach.routed_directly("10.200.0.2", table)  # the default route proves nothing
    assert reach.routed_directly("127.0.0.5", table)  # a loopback address always
    assert not reach.routed_directly("10.128.0.2", tmp_path / "missing")


def test_the_metadata_server_names_this_vms_subnets():
    md = _Metadata(
        [
            {
                "accessConfigs": [],
                "dnsServers": ["169.254.169.254"],
                "gateway": "10.128.0.1",
                "ip": "10.128.0.9",
                "mac": "42:01:0a:80:00:09",
                "mtu": 1460,
                "network": "projects/123456789/networks/llm-dev",
                "subnetmask": "255.255.240.0",
            }
        ]
    )
    try:
        assert reach.metadata_subnets(md.host) == [ipaddress.IPv4Network("10.128.0.0/20")]
        assert md.asked == ["Google"]  # the header the metadata server requires
    finally:
        md.close()
    assert reach.metadata_subnets("127.0.0.1:9") == []  # nothing answers: not on Compute Engine


def test_off_their_vpc_the_nodes_are_reached_through_iap(tmp_path, off_their_vpc):
    cluster = _cluster(tmp_path)
    r = reach.decide_reach(cluster, None)
    assert r.iap and "not in their VPC" in r.why and "--no-iap" in r.why
    assert reach.decide_reach(cluster, False) == reach.Reach(False)  # --no-iap: a VPN
    assert reach.decide_reach(cluster, True) == reach.Reach(True)  # --iap, asked: nothing to say
    assert not reach.decide_reach(cluster, None, ssh_options=("ProxyJump=bastion",)).iap  # the user's own way
    ext = _cluster(tmp_path, external=True, prefer_external=True)
    assert not reach.decide_reach(ext, None, external_ip=True).iap


def test_a_vm_on_the_nodes_subnet_goes_straight(tmp_path, monkeypatch, off_their_vpc):
    md = _Metadata([{"ip": "10.128.0.9", "subnetmask": "255.255.240.0", "network": "projects/1/networks/llm-dev"}])
    monkeypatch.setenv(reach.METADATA_HOST_ENV, md.host)
    try:
        assert reach.decide_reach(_cluster(tmp_path), None) == reach.Reach(False)
    finally:
        md.close()


def test_the_launch_says_once_that_it_goes_through_iap(tmp_path, off_their_vpc):
    r = CliRunner().invoke(main, ["exec", "--outputs", str(_outputs(tmp_path)), "--dry-run", "--", "hostname"])
    assert r.exit_code == 0, r.output
    assert r.stderr.count("not in their VPC") == 1
    assert (
        f"node 1 (10.128.0.3): through IAP: gcloud compute start-iap-tunnel llm-dev-1 22 --listen-on-stdin --zone {Z}"
        in r.stderr
    )
    straight = CliRunner().invoke(
        main, ["exec", "--outputs", str(_outputs(tmp_path)), "--no-iap", "--dry-run", "--", "hostname"]
    )
    assert straight.exit_code == 0 and "IAP" not in straight.stderr, straight.output


# ---- a tunnel that cannot open ------------------------------------------------------------------

# `gcloud compute start-iap-tunnel` refusing, as it prints IAP's error codes
# (https://cloud.google.com/iap/docs/troubleshooting-access).
FAILING_GCLOUD = textwrap.dedent(
    """\
    #!{python}
    import sys
    sys.stderr.write("ERROR: (gcloud.compute.start-iap-tunnel) Error while connecting [{code}: '{why}'].\\n")
    sys.exit(1)
    """
)


@pytest.mark.parametrize(
    ("code", "why", "names"),
    [
        ("Error while connecting [4033: ", "'not authorized'].", "iap.tunnelInstances.accessViaIAP"),
        ("Error while connecting [4003: ", "'failed to connect to backend'].", "35.235.240.0/20"),
        (
            "",
            "Cloud Identity-Aware Proxy API has not been used in project 123 before or it is disabled. Enable it by "
            "visiting https://console.developers.google.com/apis/api/iap.googleapis.com/overview?project=123",
            "gcloud services enable iap.googleapis.com",
        ),
    ],
)
def test_a_tunnel_that_cannot_open_is_one_line_naming_what_is_missing(
    tmp_path, off_their_vpc, monkeypatch, code, why, names
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAILING_GCLOUD.format(python=sys.executable, code=code, why=why))
    gcloud.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = ["exec", "--outputs", str(_outputs(tmp_path)), "--ssh-user", "alice_example_com"]
    args += ["--known-hosts", str(tmp_path / "known"), "--ssh-option", "StrictHostKeyChecking=accept-new"]
    r = CliRunner().invoke(main, [*args, "--runs-dir", str(tmp_path / "runs"), "--", "hostname"])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and names in errors[0] and "(every node; nothing was started)" in errors[0], r.stderr


# ---- OS Login -------------------------------------------------------------------------------------

FAKE_GCLOUD_ACCOUNT = textwrap.dedent(
    """\
    #!{python}
    import sys
    assert sys.argv[1:] == ["config", "get-value", "account"], sys.argv
    print({account!r})
    """
)


@pytest.fixture
def account(tmp_path, monkeypatch):
    """gcloud signed in as alice@example.com, whose key is ~/.ssh/id_ed25519(.pub) under a fake HOME."""
    bin_dir = tmp_path / "gbin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD_ACCOUNT.format(python=sys.executable, account="alice@example.com"))
    gcloud.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("private\n")
    (home / ".ssh" / "id_ed25519.pub").write_text(KEY + "\n")
    monkeypatch.setenv("HOME", str(home))
    return home / ".ssh" / "id_ed25519.pub"


@pytest.fixture(autouse=True)
def _fresh_process():
    """Each test as its own `launch` process: nothing said or read yet."""
    options._SAID.clear()
    options._LOGINS.clear()


def _login(tmp_path, api, **o):
    options._LOGINS.clear()
    cluster = _cluster(tmp_path)
    return options.oslogin_user({"oslogin_endpoint": api.endpoint, **o}, cluster, SshConfig())


def test_the_user_name_is_the_accounts_os_login_user(tmp_path, account):
    with FakeOsLogin([OsLoginUser("alice@example.com", "alice_example_com", [OTHER, KEY])]) as api:
        assert _login(tmp_path, api).user == "alice_example_com"
        (req,) = api.requests
    assert (req["method"], req["path"], req["query"]) == (
        "GET",
        "/v1/users/alice@example.com/loginProfile",
        {"projectId": ["p"]},
    )
    # --ssh-user, `User=` or a dry run: OS Login is not asked.
    with FakeOsLogin([]) as api:
        cluster = _cluster(tmp_path)
        for ssh, o in (
            (SshConfig(user="bob"), {}),
            (SshConfig(options=("User=root",)), {}),
            (SshConfig(), {"dry_run": True}),
        ):
            assert options.oslogin_user({"oslogin_endpoint": api.endpoint, **o}, cluster, ssh) == ssh
        assert api.requests == []


def test_a_key_not_registered_is_one_line_with_the_gcloud_command_and_register_key_adds_it(tmp_path, account):
    with FakeOsLogin([OsLoginUser("alice@example.com", "alice_example_com", [OTHER])]) as api:
        r = CliRunner().invoke(
            main,
            [
                "exec",
                "--outputs",
                str(_outputs(tmp_path)),
                "--no-iap",
                "--oslogin-endpoint",
                api.endpoint,
                "--",
                "true",
            ],
        )
        assert r.exit_code == 2, r.output
        assert r.output == (
            f"error: your key {account} is not in alice@example.com's OS Login profile, so the nodes would answer "
            f"Permission denied (publickey): run `gcloud compute os-login ssh-keys add --key-file={account}`, or "
            "pass --register-key\n"
        )
        assert _login(tmp_path, api, register_key=True).user == "alice_example_com"
        imported = [q for q in api.requests if q["method"] == "POST"]
        assert [(q["path"], q["body"]) for q in imported] == [
            ("/v1/users/alice@example.com:importSshPublicKey", {"key": " ".join(KEY.split()[:2])})
        ]
        assert _login(tmp_path, api).user == "alice_example_com"  # registered now: nothing more to add
        assert len([q for q in api.requests if q["method"] == "POST"]) == 1


@pytest.mark.parametrize(
    ("users", "disabled", "says"),
    [
        ([], False, "error: OS Login knows no user alice@example.com (`gcloud config get-value account`)"),
        (
            [OsLoginUser("alice@example.com", "alice_example_com", [KEY])],
            True,
            "error: the OS Login API is not enabled in project p: `gcloud services enable oslogin.googleapis.com",
        ),
        (
            [OsLoginUser("alice@example.com", "alice_example_com", [KEY], posix=False)],
            False,
            "error: alice@example.com has no OS Login user in project p: an admin grants it with",
        ),
    ],
)
def test_os_login_refusals_are_one_line_exit_2(tmp_path, account, users, disabled, says):
    with FakeOsLogin(users, disabled=disabled) as api:
        r = CliRunner().invoke(
            main,
            [
                "exec",
                "--outputs",
                str(_outputs(tmp_path)),
                "--no-iap",
                "--oslogin-endpoint",
                api.endpoint,
                "--",
                "true",
            ],
        )
    assert r.exit_code == 2, r.output
    assert r.output.startswith(says) and len(r.output.splitlines()) == 1, r.output


def test_an_os_login_api_that_does_not_answer_is_one_line_exit_2(tmp_path, account):
    import socket

    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    argv = ["exec", "--outputs", str(_outputs(tmp_path)), "--no-iap", "--oslogin-endpoint", endpoint, "--", "true"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2, r.output
    assert r.output.startswith(f"error: the OS Login API ({endpoint}) did not answer: ") and "--ssh-user" in r.output
    assert len(r.output.splitlines()) == 1, r.output
