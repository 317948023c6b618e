"""The controller's collaborators (recovery, re-adoption) reach it through one typed interface,
launcher.jobs.owner.JobOwner: the controller satisfies it, and they use nothing outside it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from launcher.cluster.key import controller_ssh
from launcher.core.types import Cluster, LaunchConfig, Node, Workload
from launcher.jobs.controller import Controller
from launcher.jobs.owner import JobOwner
from launcher.jobs.record import request_json

JOBS = Path(__file__).resolve().parents[2] / "launcher" / "jobs"


def _members() -> set[str]:
    tree = ast.parse((JOBS / "owner.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "JobOwner"]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} | {
        n.name for n in cls.body if isinstance(n, ast.FunctionDef)
    }


def _used(module: str, owner: str) -> set[str]:
    """Attributes read or called on `owner` (`c`, or `self.c`) in launcher/jobs/<module>.py."""
    used = set()
    for n in ast.walk(ast.parse((JOBS / f"{module}.py").read_text())):
        if not isinstance(n, ast.Attribute):
            continue
        v = n.value
        if owner == "c" and isinstance(v, ast.Name) and v.id == "c":
            used.add(n.attr)
        elif owner == "self.c" and isinstance(v, ast.Attribute) and v.attr == "c" and isinstance(v.value, ast.Name):
            used.add(n.attr)
    return used


def test_the_controller_is_a_job_owner(tmp_path):
    jobdir = tmp_path / "jobs" / "20260101-000000-aaaaaa"
    jobdir.mkdir(parents=True)
    cluster = Cluster("c", (Node(0, "127.0.0.1", "127.0.0.1"),))
    config = LaunchConfig(Workload("exec", ("true",)), job_id=jobdir.name)
    (jobdir / "request.json").write_text(json.dumps(request_json(cluster, config, controller_ssh("u", 22, "c", "kh"))))
    assert isinstance(Controller(jobdir), JobOwner)


def test_recovery_and_adoption_use_only_the_job_owner_interface():
    members = _members()
    assert {"record", "save", "end", "finish", "stop"} <= members
    for module, owner in (("recovery", "self.c"), ("adopt", "c")):
        used = _used(module, owner)
        assert used, f"launcher.jobs.{module} no longer reaches its controller as {owner}: update this test"
        assert used <= members, f"launcher.jobs.{module} uses {sorted(used - members)} outside JobOwner"
