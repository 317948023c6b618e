"""The launcher's import contract, read from the source (every import, a function's lazy one too):
its packages sit in layers and import only downwards (so without a cycle), and the terminal
(click, rich) is cli/'s alone. An equivalent of import-linter's `independence`/`layers`
contracts, without the dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parents[2] / "launcher"


def _module(path: Path) -> str:
    parts = path.relative_to(LAUNCHER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The layers, top to bottom (import-linter's `layers` contract): a package imports only packages
# of the layers below its own; packages of one layer are independent of each other. `""` is
# launcher/__init__.py and `__main__` launcher/__main__.py. health/ judges what core's node
# programs ask (its package docstring says why core renders the questions and health the verdict),
# so it sits above core and cluster, and everything that runs a launch's check passes its verdict.
LAYERS = (
    ("", "__main__"),
    ("cli",),
    ("nccl",),
    ("jobs",),
    ("runner", "observe"),
    ("health", "code"),
    ("cluster",),
    ("core",),
)


def _package(module: str) -> str:
    """launcher.core.launch -> "core"; a top-level module (launcher.__main__) is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> set[str]:
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)
    return out


MODULES = {_module(p): _imports(p) for p in LAUNCHER.rglob("*.py")}


def _package_graph() -> dict[str, dict[str, str]]:
    """package -> {package it imports: one module that does, for the message}."""
    graph: dict[str, dict[str, str]] = {}
    for module, imported in MODULES.items():
        src = _package(module)
        for name in imported:
            parts = name.split(".")
            if parts[0] != "launcher" or len(parts) < 2:
                continue
            dst = parts[1]
            if dst != src and ((LAUNCHER / dst).is_dir() or (LAUNCHER / f"{dst}.py").exists()):
                graph.setdefault(src, {}).setdefault(dst, module)
    return graph


def test_the_launcher_packages_import_one_another_without_a_cycle():
    graph = _package_graph()

    def visit(pkg: str, path: tuple[str, ...]) -> None:
        for dep in sorted(graph.get(pkg, {})):
            where = " -> ".join(f"{p} ({graph[p][q]})" for p, q in zip(path, (*path[1:], dep)))
            assert dep not in path, f"import cycle between launcher's packages: {where}"
            visit(dep, (*path, dep))

    for pkg in graph:
        visit(pkg, (pkg,))


def _layer(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def _upward_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    return sorted(
        f"{graph[src][dst]} ({src}, layer {_layer(src)}) imports launcher.{dst} (layer {_layer(dst)})"
        for src in graph
        for dst in graph[src]
        if _layer(dst) <= _layer(src)
    )


def test_every_package_has_a_layer():
    packages = {_package(m) for m in MODULES}
    placed = {p for layer in LAYERS for p in layer}
    assert packages <= placed, f"add {sorted(packages - placed)} to LAYERS"
    assert {"health", "core", "cli"} <= packages


def test_the_launcher_packages_import_only_the_layers_below_their_own():
    bad = _upward_imports(_package_graph())
    assert not bad, bad


def test_only_cli_imports_click_and_rich():
    bad = sorted(
        f"{module} imports {name.split('.')[0]}"
        for module, imported in MODULES.items()
        for name in imported
        if name.split(".")[0] in ("click", "rich") and _package(module) != "cli"
    )
    assert not bad, bad


# Every package but cli/: the library, which logs and returns data and leaves the terminal to cli/.
LIBRARY = sorted(p for layer in LAYERS for p in layer if p not in ("", "__main__", "cli"))

# Imports a package and every module under it in a fresh interpreter, then names the terminal's
# packages that came with them.
_LOADED_TERMINAL = """
import importlib, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
for m in pkgutil.walk_packages(getattr(pkg, "__path__", []), pkg.__name__ + "."):
    importlib.import_module(m.name)
print(" ".join(sorted({name.split(".")[0] for name in sys.modules} & {"click", "rich"})))
"""


def _terminal_loaded_by(package: str) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-c", _LOADED_TERMINAL, package],
        cwd=LAUNCHER.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("package", LIBRARY)
def test_importing_a_library_package_loads_no_terminal(package):
    """What the source check above cannot see: click or rich arriving through another module's
    import (gpufleet's, a library's). launcher.nccl renders its sweep's table as data for cli/ to
    draw (launcher.cli.nccl_table)."""
    assert _terminal_loaded_by(f"launcher.{package}") == [], f"importing launcher.{package} loads the terminal"


def test_the_import_probe_sees_the_terminal_where_it_is_loaded():
    assert "rich" in _terminal_loaded_by("launcher.cli.nccl_table")


def test_the_contract_sees_a_cycle_and_a_terminal_import_when_there_is_one(monkeypatch):
    """The checks above fail on a layout with nccl importing cli's display and click,
    and jobs and observe importing each other."""
    monkeypatch.setitem(MODULES, "launcher.nccl.from_files", {"launcher.cli.render", "click", "rich.console"})
    monkeypatch.setitem(MODULES, "launcher.observe.job_metrics", {"launcher.jobs.record"})
    graph = _package_graph()
    assert "cli" in graph["nccl"] and "nccl" in graph["cli"]
    assert "jobs" in graph["observe"] and "observe" in graph["jobs"]
    assert any(
        "launcher.observe.job_metrics (observe, layer 4) imports launcher.jobs" in b for b in _upward_imports(graph)
    )
    try:
        test_only_cli_imports_click_and_rich()
    except AssertionError as e:
        assert "launcher.nccl.from_files imports click" in str(e)
    else:
        raise AssertionError("a library importing click passed the contract")


def test_the_layers_refuse_core_importing_health_and_health_importing_the_runner(monkeypatch):
    """The cycle this layering keeps out: core rendering the verdict it is given (health imports core)."""
    monkeypatch.setitem(MODULES, "launcher.core.preflight", {"launcher.health.prestart"})
    monkeypatch.setitem(MODULES, "launcher.health.doctor", {"launcher.runner.plan"})
    bad = _upward_imports(_package_graph())
    assert "launcher.core.preflight (core, layer 7) imports launcher.health (layer 5)" in bad
    assert "launcher.health.doctor (health, layer 5) imports launcher.runner (layer 4)" in bad
