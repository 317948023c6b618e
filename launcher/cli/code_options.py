"""The options that bring code and a Python environment to the nodes (--sync, --sync-max,
--requirements, --index-url, --extra-index-url, --find-links), their mapping into a
`launcher.code.CodeRequest`, and the preparation run with progress on stderr."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from launcher.cli.render import err
from launcher.code import CodeRequest, EnvSpec, code_root, code_snapshot, prepare, take_snapshot
from launcher.code.node_agent import redact
from launcher.code.prepare import configured, warm
from launcher.code.pyenv import requirement_source, workloads_requirements
from launcher.code.snapshot import DEFAULT_SYNC_MAX, human_size, parse_size
from launcher.code.tree import DEFAULT_FANOUT
from launcher.core.transport import state_dir
from launcher.core.types import Cluster, LaunchConfig, Node, UserError

__all__ = [
    "SYNC_OPTIONS",
    "REQUIREMENTS_OPTION",
    "INDEX_OPTIONS",
    "DRY_RUN_HOME",
    "code_request",
    "dry_run_configured",
    "prepare_nodes",
    "warm_spares",
]

log = logging.getLogger("launcher")

SYNC_OPTIONS = [
    click.option(
        "--sync",
        "sync",
        type=click.Path(path_type=Path),
        metavar="DIR",
        help="Send DIR (its .gitignore and .gpufleetignore honoured, never .git) to every node; the job runs "
        "in its own copy of it (GPUFLEET_CODE: the snapshot's hash). A file already on a node is not sent again.",
    ),
    click.option(
        "--sync-follow-links",
        is_flag=True,
        help="Send what a symbolic link in the --sync directory points to even when it leaves the directory "
        "(by default such a link is refused, named: it may reach a key or a secret).",
    ),
    click.option(
        "--sync-max",
        metavar="SIZE",
        help=f"Send a --sync snapshot up to SIZE, e.g. 2GB [default: {DEFAULT_SYNC_MAX // 1000**2}MB].",
    ),
    click.option(
        "--sync-fanout",
        type=click.IntRange(min=1),
        metavar="K",
        help=f"Each node passes the content it receives on to at most K others (a tree from node 0; "
        f"the number of nodes minus one: node 0 sends to all) [default: {DEFAULT_FANOUT}].",
    ),
]

REQUIREMENTS_OPTION = click.option(
    "--requirements",
    type=click.Path(path_type=Path),
    metavar="FILE",
    help="Build the job's environment on each node from FILE (requirements.txt) [default: the --sync "
    "directory's uv.lock, else pyproject.toml, else requirements.txt].",
)

INDEX_OPTIONS = [
    click.option(
        "--index-url",
        metavar="URL",
        help="Package index (pip's meaning) [default: the stack's packageIndex, else PyPI].",
    ),
    click.option(
        "--extra-index-url",
        "extra_index_urls",
        multiple=True,
        metavar="URL",
        help="One more package index (repeatable).",
    ),
    click.option(
        "--find-links",
        "find_links",
        multiple=True,
        metavar="URL|DIR",
        help="Wheels at URL or in DIR on the nodes (repeatable).",
    ),
]


def _sync_snapshot(o: dict[str, Any]) -> tuple[Path | None, Any]:
    d = o.get("sync")
    if d is None:
        return None, None
    if not d.exists():
        raise UserError(f"--sync {d}: no such directory; give the directory to send")
    if not d.is_dir():
        raise UserError(f"--sync {d} is a file; give the directory that holds it")
    limit = parse_size(o["sync_max"]) if o.get("sync_max") else DEFAULT_SYNC_MAX
    snap = take_snapshot(d, cache=state_dir() / "hashes.json", follow_links=bool(o.get("sync_follow_links")))
    if snap.size > limit:
        largest = sorted(snap.files, key=lambda f: -f.size)[:5]
        names = ", ".join(f"{f.path} ({human_size(f.size)})" for f in largest)
        raise UserError(
            f"--sync {d} is {human_size(snap.size)}, over {human_size(limit)}; largest: {names}. Leave files out "
            "with .gpufleetignore, or allow it with --sync-max SIZE"
        )
    return d.resolve(), snap


def _refuse_conflicting_flags(o: dict[str, Any], image: str | None) -> None:
    """--python builds nothing and an image brings its own python3: neither takes the flags that
    build an environment. One line naming both flags otherwise."""
    own_python = o.get("python") is not None
    index_flags = [
        f
        for f, k in (
            ("--index-url", "index_url"),
            ("--extra-index-url", "extra_index_urls"),
            ("--find-links", "find_links"),
        )
        if o.get(k)
    ]
    if own_python and o.get("requirements"):
        raise UserError(
            f"--python {o['python']} is your own interpreter (nothing is built) and --requirements asks for an "
            "environment built from a file; drop one of them"
        )
    if own_python and index_flags:
        raise UserError(f"{index_flags[0]} has no use with --python (nothing is built); drop one of them")
    if image and (o.get("requirements") or index_flags):
        flag = "--requirements" if o.get("requirements") else index_flags[0]
        raise UserError(
            f"{flag} builds an environment on the nodes, but the ranks run in the image {image} with its own "
            "python3; put the packages in the image, or drop --image"
        )


def code_request(o: dict[str, Any], cluster: Cluster, builtin: bool) -> CodeRequest:
    """What to bring to the nodes for this launch. `builtin`: launch train or nccl-tests, whose
    ranks import gpufleet's own workloads (sent, with its requirements, unless --python)."""
    own_python = o.get("python") is not None
    image = o.get("image") or cluster.image
    _refuse_conflicting_flags(o, image)
    sync_root, sync = _sync_snapshot(o)
    if cluster.local:
        if sync is not None or o.get("requirements"):
            raise UserError("--sync and --requirements send to nodes over SSH; --local runs here: drop them")
        return CodeRequest()
    if image:
        # The image brings the environment; --sync's directory is mounted, and for launch train and
        # nccl-tests gpufleet's own code too (launcher.core.container), so a stock PyTorch image
        # (the stack's default on COS) runs them.
        code = code_snapshot() if builtin and not own_python else None
        return CodeRequest(
            code=code,
            code_root=code_root() if code is not None else None,
            sync=sync,
            sync_root=sync_root,
            fanout=o.get("sync_fanout") or DEFAULT_FANOUT,
        )
    if builtin and not own_python:
        defined = ("requirements.txt", {"requirements.txt": workloads_requirements()})
    else:
        defined = requirement_source(sync_root, o.get("requirements"))
        if defined is not None and own_python:
            log.warning(
                "%s is not installed: --python %s runs your own interpreter and builds nothing", defined[0], o["python"]
            )
            defined = None
    env = None
    if defined is not None:
        env = EnvSpec(
            kind=defined[0],
            files=defined[1],
            index_url=o.get("index_url") or cluster.package_index,
            extra_index_urls=tuple(o.get("extra_index_urls") or ()),
            find_links=tuple(o.get("find_links") or ()),
        )
    code = code_snapshot() if builtin and not own_python else None
    fanout = o.get("sync_fanout") or DEFAULT_FANOUT
    root = code_root() if code is not None else None
    return CodeRequest(code=code, code_root=root, sync=sync, sync_root=sync_root, env=env, fanout=fanout)


# What a dry run shows for the nodes' home directory (a real launch asks the nodes).
DRY_RUN_HOME = "/home/USER"


def dry_run_configured(config: LaunchConfig, request: CodeRequest, home: str) -> LaunchConfig:
    """The launch's config as the preparation leaves it (launcher.code.prepare.configured, with no
    node's own environment directory known yet: the envs/KEY link every node points at its own),
    under `home`."""
    return configured(config, request, home)


def prepare_nodes(cluster: Cluster, config: LaunchConfig, request: CodeRequest) -> LaunchConfig:
    """Run the preparation (launcher.code.prepare) with one progress line per node on stderr; a
    dry run only says what it would bring."""
    if request.empty or cluster.local:
        return config
    if config.dry_run:
        what = [
            f"{name} {snap.hash} ({len(snap.files)} files)"
            for name, snap in (("gpufleet's code", request.code), ("--sync", request.sync))
            if snap
        ]
        if request.env is not None:
            index = redact(request.env.index_url or "PyPI")  # never a URL's password on the screen
            what.append(f"environment {request.env.key} from {request.env.kind} ({index})")
        err.print(f"[dim]before the run, each node gets: {escape('; '.join(what))}[/dim]")
        # The commands as a real launch runs them once this is there: the environment's python,
        # PYTHONPATH to gpufleet's code, the --sync directory; under the nodes' home, which a
        # real launch asks the nodes for and a dry run writes as DRY_RUN_HOME.
        ready = dry_run_configured(config, request, DRY_RUN_HOME)
        added = dict(ready.env)
        shown = [f"python {ready.python}"] if ready.python != config.python else []
        shown += [f"{k}={added[k]}" for k in ("PYTHONPATH", "PATH") if added.get(k) != dict(config.env).get(k)]
        err.print(
            f"[dim]then the commands below run with {escape(', '.join(shown) or 'them')} (these variables reach "
            f"the nodes on stdin); {DRY_RUN_HOME} stands for the nodes' home directory[/dim]"
        )
        return ready

    def progress(node: Node, text: str) -> None:
        err.print(f"[dim]{escape(node.label)}: {escape(text)}[/dim]")

    n = len(cluster.nodes)
    with err.status(f"preparing {n} node{'s' * (n != 1)} (code and environment)…"):
        config, report = prepare(cluster, config, request, progress)
    if report.objects_sent or report.passed_on:
        others = f"{report.passed_on} other node{'s' * (report.passed_on != 1)}"
        how = f" ({report.levels} level{'s' * (report.levels != 1)} deep)" if report.passed_on else ""
        err.print(
            f"[dim]sent {report.objects_sent} files ({human_size(report.object_bytes)}) to "
            f"{escape(cluster.nodes[0].label)}; it passed content on to {others}{how}[/dim]"
        )
    for rank, why in sorted(report.resent.items()):
        err.print(
            f"[yellow]{escape(cluster.nodes[rank].label)} did not get its content down the tree ({escape(why)}); "
            f"{escape(cluster.nodes[0].label)} sent it directly[/yellow]"
        )
    if report.built:
        err.print(f"[dim]environment built on {len(report.built)} of {n} nodes[/dim]")
    return config


def warm_spares(cluster: Cluster, config: LaunchConfig, request: CodeRequest, spares: tuple[Node, ...]) -> None:
    """Compile the spares' environment to bytecode while they wait (launcher.code.prepare.warm), so
    a swap onto one does not spend its first start compiling what torch imports. A spare that
    cannot is named in one line and stays a spare."""
    if not spares:
        return

    def progress(node: Node, text: str) -> None:
        err.print(f"[dim]{escape(node.label)}: {escape(text)}[/dim]")

    n = len(spares)
    with err.status(f"compiling the spare{'s' * (n != 1)}' environment to bytecode…"):
        failed = warm(cluster, config, request, spares, progress)
    by_rank = {node.rank: node for node in spares}
    for rank, why in sorted(failed.items()):
        err.print(
            f"[yellow]{escape(by_rank[rank].label)}: its environment could not be compiled ahead ({escape(why)}); "
            "a swap onto it starts cold[/yellow]"
        )
