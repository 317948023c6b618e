"""The wire protocol between the launcher and the program it runs on each node: the lines the node
prints that the launcher reads (markers), the lines the launcher writes to the node (`go`, a stop's
`term` line), the run token every process of a run carries, and the `GPUFLEET_*` variables the
node program exports. Both sides (launcher.core.program builds the node's bash,
launcher.core.session reads it) take these names from here, so a marker is spelt once.

A node program travels as one bash line (`join`), so `--dry-run` prints it on one line.

Pure values and string functions: no processes, no network.
"""

from __future__ import annotations

__all__ = [
    "EXIT_MARKER",
    "STOP_REPORT",
    "PREEMPTION_NOTICE",
    "CHECKED_MARKER",
    "GO",
    "RUN_VAR",
    "JOB_ID_VAR",
    "ATTEMPT_VAR",
    "RESTART_REASON_VAR",
    "NODE_RANK_VAR",
    "NNODES_VAR",
    "grace_line",
    "stop_ticks",
    "rdzv_lock_path",
    "run_token",
    "join",
    "ENV_BLOCK_MAX",
    "env_block",
    "read_env_statements",
]

# The node's last line: `EXIT_MARKER <status>`; a lost connection prints none, which tells a
# nonzero exit of the code apart from a dropped session.
EXIT_MARKER = "__GPUFLEET_EXIT__"
# Starts the watchdog's lines about a stop (never an error line: gpufleet.contracts.is_error_line).
STOP_REPORT = "gpufleet-stop:"
PREEMPTION_NOTICE = f"{STOP_REPORT} preemption notice"
# The check half is done; the node waits for `go`.
CHECKED_MARKER = "__GPUFLEET_CHECKED__"
# The one line the launcher sends once every node has passed its check.
GO = "go"

# In the environment of every process a run starts on a node (`RUN_VAR=<job>-<node rank>`).
RUN_VAR = "GPUFLEET_RUN"
# The job's contract with the program it runs (launcher.core.env.job_env): the job id, the same on
# every attempt; the attempt, 0 then 1, 2, ...; why this attempt started (absent on attempt 0).
JOB_ID_VAR = "GPUFLEET_JOB_ID"
ATTEMPT_VAR = "GPUFLEET_ATTEMPT"
RESTART_REASON_VAR = "GPUFLEET_RESTART_REASON"
# The node's index in the launch and the launch's node count (gpufleet.groups reads them).
NODE_RANK_VAR = "GPUFLEET_NODE_RANK"
NNODES_VAR = "GPUFLEET_NNODES"


def rdzv_lock_path(address: str, port: int) -> str:
    """Relative to the node's $HOME: in the account's own ~/.gpufleet, never /tmp, where the first
    account's file (mode 600) would refuse every other account's launch on that port for good.
    Another account's job on the port is refused by its hold (launcher.core.holds). Keyed by
    address too: nodes that share a home (the simulated cluster, --local) but not a network
    namespace can each hold the same port."""
    return f".gpufleet/rdzv-{address}-{port}.lock"


def run_token(job_id: str, node_rank: int) -> str:
    """`GPUFLEET_RUN=<job>-<node>`: in the environment of every process the run half starts on
    node `node_rank` (how the watchdog, and launcher.core.stacks, find them)."""
    return f"{RUN_VAR}={job_id}-{node_rank}"


def grace_line(grace_s: float) -> bytes:
    """What the launcher writes to a node before closing its stdin, for a stop whose grace is
    `grace_s` rather than the launch's --term-grace (the watchdog reads it)."""
    return f"term {stop_ticks(grace_s)} {grace_s:g}\n".encode()


def stop_ticks(grace_s: float) -> int:
    """The watchdog's ticks in a grace of `grace_s`."""
    return max(1, round(grace_s * 5))  # the watchdog looks every 0.2 s


# What the --env values may come to on stdin: less than a pipe's buffer (64 KiB on Linux, pipe(7)),
# so writing them never waits for the node to read.
ENV_BLOCK_MAX = 32768


def env_block(pairs: list[tuple[str, str]]) -> bytes:
    """The user's --env values as the launcher writes them to a node's stdin before anything
    else, one line per value in `pairs`' order (`read_env_statements` reads them): each backslash
    doubled and each newline written as backslash-n, so a value is one line and bash's
    `printf %b` gives it back byte for byte. Values never go on a command line, where `ps` on
    every machine shows them for the whole job."""
    return b"".join(
        value.replace("\\", "\\\\").replace("\n", "\\n").encode("utf-8", "surrogateescape") + b"\n"
        for _, value in pairs
    )


# The variable a value is read into first (the user's variable names are never this one).
_READ_VAR = "_GPUFLEET_ENV_VALUE"


def read_env_statements(key: str, prepend: bool = False) -> list[str]:
    """Bash that reads one `env_block` line from stdin and exports it as `key` (prepended to the
    node's value for a PATH-like `key`); end of input (the launcher gave up before sending it)
    ends the program before anything ran. `key` is a checked variable name; the value is only
    read (`read -r`) and decoded (`printf -v`), both builtins: no eval, no process, no argv."""
    v = _READ_VAR
    value = f"${v}${{{key}:+:${key}}}" if prepend else f"${v}"
    return [f"IFS= read -r {v} || exit 0", f'printf -v {v} %b "${v}"', f'export {key}="{value}"', f"unset {v}"]


def join(statements: list[str]) -> str:
    """Statements on one line; `a &; b` is a syntax error: one ending in `&` is already terminated."""
    return " ".join(st if st.endswith("&") else st + ";" for st in statements).rstrip(";")
