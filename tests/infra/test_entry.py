"""How the program is entered: Pulumi.yaml points at `infra/`, Pulumi runs that directory's
__main__.py; and which modules stay free of pulumi (the launcher reads gpufleet.contracts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from gpufleet.contracts import OUTPUT_KEYS
from infra.preview import MAIN, preview_program
from tests.infra.conftest import BASE

ROOT = Path(__file__).resolve().parents[2]


def test_pulumi_yaml_runs_the_infra_directory_with_python():
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    assert project["name"] == "gpufleet"
    assert project["runtime"]["name"] == "python"
    assert (ROOT / project["main"] / "__main__.py").resolve() == Path(MAIN).resolve()


def test_the_example_stack_file_is_a_valid_config():
    stack = yaml.safe_load((ROOT / "Pulumi.example.yaml").read_text())["config"]
    p = preview_program(stack, stack="example")
    assert sorted(p.outputs) == sorted(OUTPUT_KEYS)
    assert len(p.outputs["nodes"]) == int(stack["gpufleet:nodes"])
    assert p.outputs["cluster"] == stack["gpufleet:name"]


def test_running_the_directory_as_pulumi_does_declares_the_fleet():
    # runpy.run_path on the directory: sys.path[0] becomes infra/ itself, not the repo root.
    p = preview_program({**BASE, "gpufleet:nodes": "3"}, main=str(Path(MAIN).parent))
    assert [n["name"] for n in p.outputs["nodes"]] == ["dev-0", "dev-1", "dev-2"]


def test_config_contract_layout_and_startup_do_not_import_pulumi():
    code = (
        "import sys, infra, infra.config, infra.layout, infra.startup, gpufleet.contracts; "
        "from gpufleet.catalog import lookup; "
        "infra.config.parse_spec({'gcp:project': 'gpufleet-test', 'gcp:zone': 'us-central1-a'}, stack='dev'); "
        "infra.startup.render_startup_script(lookup('a3-megagpu-8g'), cluster='x', image_os='ubuntu'); "
        "assert not [m for m in sys.modules if m.startswith('pulumi')], sorted(sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
