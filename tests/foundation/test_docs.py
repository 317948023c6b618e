"""The documentation says what the code does: the README stays a short entry whose links resolve,
every example runs as written (it names its nodes), and the facts the docs state are read here
from the code that decides them. `make docs` (mkdocs build --strict) checks the site's own links
and anchors; these are the checks a link checker cannot make."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _example_lines(text: str) -> list[str]:
    """The commands of fenced (```) and indented (4 spaces) code blocks, as a user would paste
    them: a line ending in a backslash joined with the next."""
    lines, fenced, held = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            held += line.strip()
            if held.endswith("\\"):
                held = held[:-1] + " "
                continue
            lines.append(held)
        held = ""
    return lines


# A command that names no node source runs only in these forms: reading output that exists
# (--from), drawing a record (--plot), and the memory plan (--dry-run with --nodes and --machine-type).
_NODE_SOURCE = re.compile(r"--(stack|outputs|hostfile|label|local)\b")
_NO_SOURCE_NEEDED = re.compile(r"--from\b|--plot\b|--help\b|\s-h\b")


# `launch top: ...` is the view's title in an output sample, not a command.
_LAUNCH = re.compile(r"launch (train|run|exec|hosts|doctor|top|nccl-tests|jobs|logs|attach|stop)\b(?!:)")


def _needs_no_source(cmd: str) -> bool:
    plan = "--dry-run" in cmd and "--nodes" in cmd and "--machine-type" in cmd
    return bool(_NODE_SOURCE.search(cmd) or _NO_SOURCE_NEEDED.search(cmd)) or plan


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if not t.startswith("http")]
    assert links and [t for t in links if not (ROOT / t).exists()] == []


def test_every_launch_example_names_its_nodes():
    """An example without a node source fails as written (`give exactly one node source`)."""
    bad = []
    for page in _pages():
        for line in _example_lines(page.read_text()):
            for part in line.removeprefix("$ ").split(" | "):
                if _LAUNCH.match(part) and not _needs_no_source(part):
                    bad.append(f"{page.relative_to(ROOT)}: {part}")
    assert bad == []


def test_detach_help_names_the_controller_host():
    from launcher.cli.main import main

    out = CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output
    detach = " ".join(out.split("--detach", 1)[1].split("--", 1)[0].split())
    assert "controller host" in detach and "controller on node 0" not in detach


def test_the_restart_roles_permissions_are_the_ones_documented():
    from infra.restart_grant import RESTART_PERMISSIONS

    fleet = (DOCS / "fleet.md").read_text()
    section = fleet.split("**The restart role**", 1)[1].split("\n\n", 1)[0]
    assert len(RESTART_PERMISSIONS) == 3 and "exactly three permissions" in section
    assert all(f"`{p}`" in section for p in RESTART_PERMISSIONS)
    recovery = " ".join((DOCS / "recovery.md").read_text().split())
    assert all(f"`{p}`" in recovery for p in RESTART_PERMISSIONS)


def test_every_restart_reason_is_documented():
    from launcher.jobs.restarts import REASONS

    row = next(
        r for r in (DOCS / "own-code.md").read_text().splitlines() if r.startswith("| `GPUFLEET_RESTART_REASON`")
    )
    assert all(f"`{reason}`" in row for reason in (*REASONS, "shrunk"))


def test_the_sweep_step_factor_defaults_are_the_ones_documented():
    from gpufleet.collectives import SweepSpec
    from workloads.sweep_args import build_parser

    fabric = (DOCS / "fabric.md").read_text()
    row = next(r for r in fabric.splitlines() if r.startswith("| `-f` / `-i` |"))
    sweep = build_parser().parse_args([])
    assert row.split(" | ")[-1].startswith(f"`{sweep.stepfactor}` / `1M`")
    assert f"`launch nccl-tests -f`: `{SweepSpec().stepfactor}`" in row
    assert f"its `-f` is `{SweepSpec().stepfactor}`" in fabric


def test_the_client_state_paths_are_the_ones_documented(tmp_path, monkeypatch):
    """known_hosts/<cluster>-<hash> and <cluster>-<hash>/id_ed25519 under the state directory."""
    from launcher.cluster.key import cluster_slug
    from launcher.core.transport import state_dir
    from launcher.core.types import Cluster, Node

    monkeypatch.delenv("GPUFLEET_STATE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert state_dir() == tmp_path / ".cache" / "gpufleet"
    slug = cluster_slug(Cluster("llm-dev", (Node(0, "n0", "10.0.0.2"),), "a3-megagpu-8g", project="p", zone="z"))
    assert re.fullmatch(r"llm-dev-[0-9a-f]{10}", slug)
    launch = " ".join((DOCS / "launch.md").read_text().split())
    detached = " ".join((DOCS / "detached.md").read_text().split())
    assert "`~/.cache/gpufleet/known_hosts/<cluster>-<hash>`" in launch
    assert "`~/.cache/gpufleet/<cluster>-<hash>/id_ed25519`" in detached


# ---- one voice: the names the pages share --------------------------------------------------------

STACK = "llm-dev"  # the one stack name the examples use


def _prose(page: Path) -> str:
    return " ".join(page.read_text().split())


def test_every_example_names_the_same_stack():
    """`--stack NAME`, `pulumi stack init NAME` and `Pulumi.NAME.yaml` in any page's examples name
    one stack (placeholders in capitals, like `--stack NAME`, excepted)."""
    forms = re.compile(r"--stack (\S+)|stack init (\S+)|Pulumi\.([a-z][\w-]*)\.yaml")
    # The repository's own stack files (Pulumi.example.yaml, examples/Pulumi.a4.yaml, ...) are
    # files, not stack names a reader picks.
    files = {p.name.split(".")[1] for p in ROOT.glob("**/Pulumi.*.yaml") if ".venv" not in p.parts}
    other = []
    for page in _pages():
        for m in forms.finditer(page.read_text()):
            name = next(g for g in m.groups() if g).strip("`'\"),.")
            if name not in (STACK, *files) and not name.isupper():
                other.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
    assert other == []


def test_the_controller_host_is_never_called_the_job_host():
    from launcher.cli.main import main

    pages = [str(p.relative_to(ROOT)) for p in _pages() if "job host" in _prose(p)]
    assert pages == []
    for name in main.list_commands(None):
        out = CliRunner().invoke(main, [name, "--help"], terminal_width=200).output
        assert "job host" not in " ".join(out.split()), name


def test_the_bare_nodes_page_has_one_name():
    """Its title, its nav entry and every link to it call it "Bare nodes"."""
    title = (DOCS / "bare-nodes.md").read_text().splitlines()[0]
    assert title.startswith("# Bare nodes")
    nav = [ln.strip() for ln in (ROOT / "mkdocs.yml").read_text().splitlines() if ln.strip().endswith("bare-nodes.md")]
    assert nav and all(ln.startswith("- Bare nodes") for ln in nav), nav
    links = [
        (str(p.relative_to(ROOT)), text)
        for p in _pages()
        for text in re.findall(r"\[([^\]]+)\]\((?:docs/)?bare-nodes\.md", p.read_text())
    ]
    assert links and [(p, t) for p, t in links if not t.lower().startswith("bare nodes")] == []


def test_nothing_is_installed_on_the_nodes_by_hand():
    """README says nothing goes on the nodes; no page tells you to pip install there."""
    assert "nothing on the nodes" in _prose(ROOT / "README.md")
    told = [
        f"{p.relative_to(ROOT)}: {line}"
        for p in _pages()
        for line in _example_lines(p.read_text())
        if "pip install" in line and "on the nodes" in line
    ]
    assert told == []


def test_the_first_cluster_page_is_linked_and_in_the_nav():
    assert "first-cluster.md" in (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "README.md", DOCS / "getting-started.md", DOCS / "index.md"):
        assert "first-cluster.md" in page.read_text(), page


def test_the_first_cluster_page_takes_a_reader_from_an_empty_project_to_teardown():
    """Every step the road needs is on the page, in order, with the facts the code decides."""
    from gpufleet.catalog import machine_price
    from launcher.cluster.reach import decide_reach
    from launcher.core.access import IAP_RANGE
    from launcher.core.types import Cluster, Node

    text = (DOCS / "first-cluster.md").read_text()
    steps = [
        "gcloud auth login",
        "gcloud auth application-default login",
        "gcloud services enable compute.googleapis.com iap.googleapis.com oslogin.googleapis.com",
        "roles/iap.tunnelResourceAccessor",
        "roles/compute.osLogin",
        "roles/compute.osAdminLogin",
        "roles/iam.serviceAccountUser",
        "gcloud compute os-login ssh-keys add --key-file=",
        "--register-key",
        "--ssh-user",
        "PULUMI_CONFIG_PASSPHRASE",
        f"pulumi stack init {STACK}",
        f"python -m infra.preview --stack {STACK}",
        f"pulumi up --stack {STACK}",
        f"launch hosts --stack {STACK}",
        f"launch train --stack {STACK} --nodes 2",
        f"launch nccl-tests --stack {STACK}",
        f"pulumi destroy --stack {STACK}",
    ]
    at = [text.find(s) for s in steps]
    assert -1 not in at, [s for s, i in zip(steps, at) if i < 0]
    assert at == sorted(at), "the steps are out of order"
    assert IAP_RANGE in text
    # The price it quotes is the catalog's, for the two nodes it declares.
    price = machine_price("a3-megagpu-8g")
    assert f"about **${2 * price.on_demand_usd_per_hour:.0f} an hour**" in text
    assert f"about ${2 * price.spot_usd_per_hour:.0f} on Spot" in text
    # The line it says the launch prints is the one the launch prints.
    cluster = Cluster(
        STACK, tuple(Node(i, f"10.128.0.{i + 2}", f"10.128.0.{i + 2}", name=f"{STACK}-{i}") for i in (0, 1))
    )
    why = decide_reach(cluster, None, external_ip=False).why
    assert why is None or why in text  # None here only where this machine is in 10.128.0.0's network
    assert "the nodes have no external address and this machine is not in their VPC" in text


def test_troubleshooting_ssh_covers_permission_denied_publickey():
    text = (DOCS / "troubleshooting-ssh.md").read_text()
    assert "## Permission denied (publickey)" in text
    assert "gcloud compute os-login ssh-keys add --key-file=" in text and "--register-key" in text
    assert "#permission-denied-publickey" in (DOCS / "first-cluster.md").read_text()


def test_readme_first_launches_work_through_iap_by_themselves():
    """The stack's nodes have no external address: the README's first launches need no --iap
    (it is the default from outside the VPC), and the README says so."""
    readme = (ROOT / "README.md").read_text()
    launches = [ln for ln in _example_lines(readme) if ln.startswith("launch ") and "--stack" in ln]
    assert launches and not any("--iap" in ln or "--external-ip" in ln for ln in launches)
    assert "IAP tunnel by itself" in _prose(ROOT / "README.md")


def test_make_docs_serve_installs_the_docs_extra_itself():
    make = (ROOT / "Makefile").read_text()
    rule = re.search(r"^docs-serve: (.*)$", make, re.M)
    assert rule and "$(VENV)/.docs-installed" in rule.group(1)
    assert "make docs-serve" in (ROOT / "README.md").read_text()
    assert ".venv/bin/mkdocs serve" not in (ROOT / "README.md").read_text()


def test_the_readme_says_where_the_built_cli_reference_is():
    readme = _prose(ROOT / "README.md")
    assert "(docs/reference/cli.md)" in readme and "http://127.0.0.1:8000/reference/cli/" in readme
    assert "::: mkdocs-click" in (DOCS / "reference" / "cli.md").read_text()
