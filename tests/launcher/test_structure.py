"""The launcher's shape: one job per module, no reaching into another module's private
names, no import cycle, and functions short enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parents[2] / "launcher"

# The modules around the Launch object, and the command modules that share the CLI's
# options (launcher.cli.options) and display (launcher.cli.render) by their public names.
SPLIT = [
    "cli.main",
    "core.program",
    "cluster.discovery",
    "core.env",
    "core.launch",
    "core.types",
    "cli.options",
    "core.output",
    "core.preflight",
    "cli.render",
    "core.session",
    "core.transport",
    "core.wire",
    "core.ssh",
    "core.torchrun",
    "runner.plan",
]
COMMANDS = ["cli.cmd_doctor", "cli.cmd_top", "cli.cmd_nccl_tests", "cli.nccl_from", "nccl.from_files"]
# The collective sweep's report, split by job: parse, judge, render and store, find a
# bad node, the mpirun command; nccl.report gathers their public names.
REPORT = ["nccl.parse", "nccl.judge", "nccl.render", "nccl.badnodes", "nccl.mpirun", "nccl.report"]
# Pure command builders may run long: each line is one statement of the node-side program.
BUILDERS = {("health.script", "node_script")}


def _name(path: Path) -> str:
    """launcher/core/launch.py -> "core.launch"; a package's __init__.py -> the package's name."""
    parts = path.relative_to(LAUNCHER).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Every module of the package and its subpackages, for the rules that hold everywhere.
ALL = sorted(_name(p) for p in LAUNCHER.rglob("*.py") if p.relative_to(LAUNCHER).as_posix() != "__init__.py")


def _path(name: str) -> Path:
    base = LAUNCHER.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _tree(name: str) -> ast.Module:
    return ast.parse(_path(name).read_text())


def _launcher_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    return [
        n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "launcher"
    ]


@pytest.mark.parametrize("name", ALL)
def test_no_private_name_of_another_launcher_module_is_imported(name):
    private = [
        f"{n.module}.{a.name}" for n in _launcher_imports(_tree(name)) for a in n.names if a.name.startswith("_")
    ]
    assert not private, f"launcher.{name} imports {private}"


@pytest.mark.parametrize("name", ALL)
def test_every_function_is_under_60_lines(name):
    long = [
        f"{f.name} ({f.end_lineno - f.lineno + 1} lines)"
        for f in ast.walk(_tree(name))
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        and f.end_lineno - f.lineno + 1 >= 60
        and (name, f.name) not in BUILDERS
    ]
    assert not long, f"launcher.{name}: {long}"


def _deps(name: str) -> set[str]:
    """The launcher modules `name` imports: `from launcher.a.b import x` -> "a.b", and
    `from launcher.a import b` -> "a.b" when b is a module, else "a"."""
    deps = set()
    for n in _launcher_imports(_tree(name)):
        module = n.module.split(".", 1)[1] if "." in n.module else ""
        for a in n.names:
            sub = f"{module}.{a.name}" if module else a.name
            if sub in ALL:
                deps.add(sub)
            elif module:
                deps.add(module)
    return deps - {name}


def test_the_launcher_modules_import_no_cycle():
    graph = {name: _deps(name) for name in ALL}

    def visit(name: str, path: tuple[str, ...]) -> None:
        for dep in graph.get(name, ()):
            assert dep not in path, "import cycle: " + " -> ".join((*path, dep))
            visit(dep, (*path, dep))

    for name in ALL:
        visit(name, (name,))


def test_library_modules_never_print():
    """rich and print() belong to the CLI, which renders the launch's events and result."""
    for name in (set(SPLIT) | set(REPORT)) - {"cli.main", "cli.render"}:
        tree = _tree(name)
        calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        assert "print" not in calls, f"launcher.{name} prints"
        assert not any(
            n.module.startswith("rich") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        ), f"launcher.{name} imports rich"


def test_node_state_changes_in_one_place():
    """`Launch._set_state` is the only code that assigns a node's state."""
    tree = _tree("core.launch")
    writers = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
                for t in targets:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "states":
                        writers.add(fn.name)
    assert writers == {"_set_state"}


def _calls_of(tree: ast.Module, module: str, attr: str) -> list[int]:
    """Lines that call `module.attr(...)`, or `attr(...)` imported from `module`."""
    imported = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == module
        for a in n.names
        if a.name == attr
    }
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and (
            (
                isinstance(n.func, ast.Attribute)
                and n.func.attr == attr
                and isinstance(n.func.value, ast.Name)
                and n.func.value.id == module
            )
            or (isinstance(n.func, ast.Name) and n.func.id in imported)
        )
    ]


@pytest.mark.parametrize("name", ["cli.cmd_nccl_tests", "nccl.badnodes"])
def test_nccl_tests_and_the_bad_node_search_leave_signals_to_launch(name):
    """Signal handling is Launch's (launcher.core.launch): the nccl-tests command and the bad-node
    search install no handler of their own, and drive `Launch` rather than copying it."""
    tree = _tree(name)
    assert not _calls_of(tree, "signal", "signal"), f"launcher.{name} installs a signal handler"
    assert not _calls_of(tree, "signal", "set_wakeup_fd"), f"launcher.{name} touches signal delivery"
    if name == "nccl.badnodes":
        assert _calls_of(tree, "launcher.core.launch", "Launch"), "the bad-node search does not drive Launch"


def test_the_compatibility_module_run_is_gone_and_nothing_imports_it():
    assert not (LAUNCHER / "run.py").exists()
    repo = LAUNCHER.parent
    for path in [*LAUNCHER.rglob("*.py"), *(repo / "tests").rglob("*.py"), *(repo / "bench").glob("*.py")]:
        tree = ast.parse(path.read_text())
        bad = [
            n.lineno
            for n in ast.walk(tree)
            if (isinstance(n, ast.ImportFrom) and n.module == "launcher.run")
            or (isinstance(n, ast.Import) and any(a.name == "launcher.run" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and n.module == "launcher" and any(a.name == "run" for a in n.names))
        ]
        assert not bad, f"{path.relative_to(repo)}:{bad[0]} imports launcher.run"


def _imported(name: str) -> tuple[set[str], set[str]]:
    """What module `name` imports anywhere in it (a function's lazy import too): the launcher
    modules, each with the packages above it (importing one runs their __init__), and the
    top-level names of everything else."""
    inner, outer = set(), set()
    for n in ast.walk(_tree(name)):
        if isinstance(n, ast.Import):
            dotted = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            dotted = [n.module, *(f"{n.module}.{a.name}" for a in n.names)]
        else:
            continue
        for d in dotted:
            parts = d.split(".")
            if parts[0] != "launcher":
                outer.add(parts[0])
                continue
            inner.update(m for m in (".".join(parts[1:i]) for i in range(2, len(parts) + 1)) if m in ALL)
    return inner, outer


@pytest.mark.parametrize("package", ["core", "jobs", "health"])
def test_core_and_jobs_import_neither_click_nor_rich(package):
    """Node 0 runs core/ and jobs/ with `python -S` (no site-packages), and with them the
    pre-start verdict of health/ that the controller passes its launches; library code leaves the
    display to the CLI: none of them reaches click or rich, through any launcher module."""
    start = [m for m in ALL if m == package or m.startswith(package + ".")]
    via = {m: (m,) for m in start}
    todo = list(start)
    while todo:
        name = todo.pop()
        inner, outer = _imported(name)
        bad = outer & {"click", "rich"}
        assert not bad, f"launcher.{package} reaches {sorted(bad)}: " + " -> ".join(via[name])
        for dep in inner - via.keys():
            via[dep] = (*via[name], dep)
            todo.append(dep)
