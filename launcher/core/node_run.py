"""The run half of a launch, on the node, in Python: the first part of a launch the node agent does
from its typed plan instead of generated shell (docs/design-node-program.md, "The typed plan").
An attached run's bash program ends, after `go` and the prepare steps, with
`python3 -I -S -c SOURCE run PLAN` (launcher.core.program; a detached job's starts `supervise PLAN
DIR`, the `Supervised` class below): SOURCE is this module's code (a node has nothing of gpufleet
installed: standard library only, Python 3.8 or newer), PLAN the node's
`gpufleet.node_plan.NodePlan` as JSON. It reads the plan's run half: `argv` (the rank command in
its wrappers), the run token (its `GPUFLEET_RUN` variable) and `limits` (the stop's grace, the
preemption watch), and then:

- starts `argv` in a session of its own, the token in its environment only, its stdin /dev/null,
  its stderr on its stdout (the rendezvous lock on fd 9, when the check took it, stays held by
  this process and the workload until the run ends);
- watches its own stdin, the launcher's: a `term TICKS SECONDS` line is a stop's own grace
  (launcher.core.wire.grace_line), the end of input (the launcher closed it, or the connection
  dropped) or SIGHUP/SIGTERM to this process stops the run;
- on a Spot VM, watches the metadata server's `instance/preempted` and stops the run on the
  notice (one PREEMPTION_NOTICE line first);
- a stop: SIGTERM to the workload's process group and to every rank (torchrun's workers run in
  sessions of their own), up to the grace for them to exit, SIGKILL to the ranks left, one
  STOP_REPORT line per rank, then every process that carries the token killed;
- a run that failed has what it left behind killed the same way;
- prints `EXIT_MARKER <status>` last and exits with the workload's status (128 + N for a
  workload killed by signal N, as bash reports it).

A rank is a process with the token and torchrun's `RANK` in its environment whose parent is not
one (a data-loader child inherits both). They are looked for among the workload's descendants
(one read of each process's `stat`, then the environment of those few): a stop does not read every
process's environment before its SIGTERM. Only a container's ranks, which the runtime's monitor
starts outside the workload's tree (the plan's `container`), are looked for among every process.

Names the launcher reads (the markers) are launcher.core.wire's, repeated here because this
program runs without gpufleet; tests/launcher/test_node_run.py holds them equal.
"""

import base64
import fcntl
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

# launcher.core.node_start travels above this module's code, in the same source (launcher.core.program).
from launcher.core.node_start import (
    CHECKED_MARKER,
    COMPILE_CACHES,
    GO,
    LOCAL_CHECKPOINT_VAR,
    LOCAL_DIR_VAR,
    LOCK_FD,
    Ended,
    Start,
    home,
    unescape,
)

SCHEMA = 2  # gpufleet.node_plan.SCHEMA_VERSION
RUN_VAR = "GPUFLEET_RUN"
STOP_REPORT = "gpufleet-stop:"
PREEMPTION_NOTICE = STOP_REPORT + " preemption notice"
EXIT_MARKER = "__GPUFLEET_EXIT__"
ERROR_PREFIX = "gpufleet: "  # gpufleet.contracts.LAUNCHER_ERROR_PREFIX
ORPHAN_STOP = STOP_REPORT + " no controller for"  # launcher.core.supervise.ORPHAN_STOP
TICK_S = 0.2  # launcher.core.wire.stop_ticks: a grace of S seconds is round(S * 5) ticks
NODE_RUNS_DIR = ".gpufleet/node-runs"  # launcher.core.supervise.NODE_RUNS_DIR
CONTAINER = "gpufleet-container"  # launcher.core.container: an argv this program runs in a container
RUNTIME_ENV = "GPUFLEET_CONTAINER_RUNTIME"  # launcher.core.container.RUNTIME_ENV
# What the local-dir prepare step exports where it found the account's own directory: the
# container gets them by name, and the directory itself, only then (launcher.core.container).
NODE_LOCAL_VARS = (LOCAL_DIR_VAR, LOCAL_CHECKPOINT_VAR) + tuple(var for var, _ in COMPILE_CACHES)


def say(line):
    """One line on stdout, the launcher's: written whole; a dropped connection loses it, and the
    stop goes on."""
    try:
        os.write(1, (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def stat(pid):
    """(state, parent pid) of `pid`, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return fields[0].decode(), int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def gone(pid):
    s = stat(pid)
    return s is None or s[0] == "Z"


def environ(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def carrying(token, candidates):
    """{pid: its RANK or None} of the `candidates` whose environment holds `token`."""
    out, entry = {}, token.encode()
    for pid in candidates:
        env = environ(pid)
        if entry in env:
            out[pid] = next((e[5:].decode() for e in env if e.startswith(b"RANK=") and e[5:].isdigit()), None)
    return out


def descendants(root):
    """`root` and every process below it, from one pass over the processes' parents."""
    children = {}
    for pid in pids():
        s = stat(pid)
        if s is not None:
            children.setdefault(s[1], []).append(pid)
    out, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def ranks(token, root, anywhere=False):
    """[(pid, rank)] of the run's ranks, in rank order (see the module docstring); `anywhere`:
    they may run outside the workload's tree (a container's)."""
    found = carrying(token, pids() if anywhere else descendants(root))
    with_rank = {pid: r for pid, r in found.items() if r is not None}
    out = []
    for pid, rank in with_rank.items():
        s = stat(pid)
        if s is not None and s[1] not in with_rank:
            out.append((pid, rank))
    return sorted(out, key=lambda e: (int(e[1]), e[0]))


def signal_pid(pid, sig):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False


def reap(token):
    """SIGKILL to every process that carries the token (what a failure or a stop left behind)."""
    for pid in carrying(token, pids()):
        signal_pid(pid, signal.SIGKILL)


class Run:
    """One attached run of a plan (see the module docstring)."""

    def __init__(self, plan):
        self.argv = list(plan["argv"])
        self.token = next(
            RUN_VAR + "=" + e["value"] for e in plan["env"] if e["name"] == RUN_VAR and e["value"] is not None
        )
        grace = float(plan["limits"]["term_grace_s"])
        self.grace = (max(1, round(grace * 5)), "%g" % grace)  # (ticks, seconds as the report says them)
        self.watch = bool(plan["limits"]["watch_preemption"])
        self.contained = plan["container"] is not None
        self.lock = threading.Lock()
        self.stopping = self.ended = False
        self.stopped = threading.Event()
        self.proc = None

    def start(self):
        env, argv = dict(os.environ), self.argv
        env[RUN_VAR] = self.token.partition("=")[2]
        if argv[0] == CONTAINER:  # this program's `container`, which carries no token itself
            argv = [sys.executable, "-I", "-S", "-c", own_source(), "container", *argv[1:]]
            del env[RUN_VAR]
        try:
            os.fstat(LOCK_FD)
            keep = (LOCK_FD,)
        except OSError:
            keep = ()
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=keep,
            )
        except OSError as e:
            say("%sfailed to execute %s: %s" % (ERROR_PREFIX, self.argv[0], e.strerror))
            return 127 if isinstance(e, FileNotFoundError) else 126
        return None

    def stop(self, notice=False):
        """Stop the run once, whichever watcher asks first; nothing once the workload has ended."""
        with self.lock:
            if self.stopping or self.ended:
                return
            self.stopping = True
        ticks, seconds = self.grace
        if notice:
            say(
                "%s (instance/preempted is TRUE): SIGTERM to every rank, SIGKILL after %s s"
                % (PREEMPTION_NOTICE, seconds)
            )
        found = ranks(self.token, self.proc.pid, anywhere=self.contained)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except OSError:
            pass
        for pid, _ in found:
            signal_pid(pid, signal.SIGTERM)
        for _ in range(ticks):
            if not group_alive(self.proc.pid) and all(gone(pid) for pid, _ in found):
                break
            time.sleep(TICK_S)
        for pid, rank in found:
            if gone(pid):
                say("%s rank %s (pid %d) exited by itself after SIGTERM" % (STOP_REPORT, rank, pid))
            else:
                signal_pid(pid, signal.SIGKILL)
                say("%s rank %s (pid %d) killed: still running %s s after SIGTERM" % (STOP_REPORT, rank, pid, seconds))
        reap(self.token)
        self.stopped.set()

    def watch_stdin(self):
        """The launcher's stdin: `term TICKS SECONDS` lines, then its end."""
        for line in sys.stdin.buffer:
            words = line.split()
            if len(words) == 3 and words[0] == b"term" and words[1].isdigit():
                self.grace = (int(words[1]), words[2].decode())
        self.stop()

    def watch_preemption(self):
        """A Spot VM's preemption notice: the metadata server's `instance/preempted` turns TRUE
        when Compute Engine sends the guest its ACPI soft-off, 30 s before the VM stops
        (https://cloud.google.com/compute/docs/instances/spot#detecting_if_a_vm_was_preempted),
        asked with a hanging GET that gives up after 10 s
        (https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange).
        GCE_METADATA_HOST (the variable google-auth reads) names another server. Without a
        server, or on an error, the watch ends and the run goes on."""
        host = os.environ.get("GCE_METADATA_HOST") or "metadata.google.internal"
        url = "http://%s/computeMetadata/v1/instance/preempted" % host
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        value, timeout, query = "", 5, ""
        while value != "TRUE":
            request = urllib.request.Request(url + query, headers={"Metadata-Flavor": "Google"})
            try:
                with opener.open(request, timeout=timeout) as response:
                    value = response.read().decode().strip()
            except Exception:  # noqa: BLE001 -- any failure ends the watch, as curl's did
                return
            timeout, query = 20, "?wait_for_change=true&timeout_sec=10"
        self.stop(notice=True)

    def on_signal(self, signum, frame):
        threading.Thread(target=self.stop, daemon=True).start()

    def started(self):
        """Called once the workload runs (or could not be started)."""

    def run(self, watchers, signals=(signal.SIGHUP, signal.SIGTERM)):
        """Start the workload, stop it when one of `watchers` (run in threads) or one of `signals`
        says so, and return its status once it (and a stop) has ended."""
        for sig in signals:
            signal.signal(sig, self.on_signal)
        failed = self.start()
        self.started()
        if failed is not None:
            return failed
        for watcher in (*watchers, *([self.watch_preemption] if self.watch else [])):
            threading.Thread(target=watcher, daemon=True).start()
        rc = self.proc.wait()
        with self.lock:
            self.ended = True
            stopping = self.stopping
        if stopping:
            self.stopped.wait()
        rc = 128 - rc if rc < 0 else rc
        if rc != 0:
            reap(self.token)
        return rc


class Supervised(Run):
    """A detached job's run, which outlives the session that started it (launcher.core.supervise
    has the layout of its directory `run_dir` and the session that streams its output): this
    program is its supervisor, in a session of its own with its output appended to `out`. It
    writes `pid` (its own pid, twice: the supervisor's and the one a stop request wakes) once the
    workload runs and `rc` when it ends, each whole (a rename). It stops the run on a stop request
    (the file `stop`, `TICKS SECONDS`, with SIGUSR1 to wake it), a preemption notice, SIGTERM, or
    when no session has held `attached` (flock(2), shared) for the plan's controller grace."""

    def __init__(self, plan, run_dir):
        super().__init__(plan)
        self.dir = run_dir
        self.orphan_s = int(plan["limits"]["controller_grace_s"])
        self.wake = threading.Event()

    def on_wake(self, signum, frame):
        self.wake.set()

    def write(self, name, text):
        """`name` in the run's directory, whole (a rename); where it cannot be written (a full
        disk), one line says so and the run goes on."""
        path = os.path.join(self.dir, name)
        try:
            with open(path + ".new", "w") as f:
                f.write(text)
            os.replace(path + ".new", path)
        except OSError as e:
            say("%scannot write %s: %s (is the disk full?)" % (ERROR_PREFIX, path, e.strerror))

    def requested(self):
        """The stop request's grace, (ticks, seconds), or None."""
        try:
            with open(os.path.join(self.dir, "stop")) as f:
                words = f.read().split()
        except OSError:
            return None
        if len(words) == 2 and words[0].isdigit():
            return int(words[0]), words[1]
        return self.grace

    def attached(self):
        """Whether a session holds `attached` (its shared lock keeps this exclusive one out)."""
        fd = os.open(os.path.join(self.dir, "attached"), os.O_RDONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def watch_controller(self):
        alone_since = None
        while True:
            self.wake.wait(1)
            self.wake.clear()
            request = self.requested()
            if request is not None:
                self.grace = request
                return self.stop()
            if self.attached():
                alone_since = None
                continue
            alone_since = alone_since or time.monotonic()
            if time.monotonic() - alone_since >= self.orphan_s:
                say(
                    "%s %d s (--controller-grace): SIGTERM to every rank, SIGKILL after %s s"
                    % (ORPHAN_STOP, self.orphan_s, self.grace[1])
                )
                return self.stop()

    def supervise(self):
        signal.signal(signal.SIGUSR1, self.on_wake)
        rc = self.run([self.watch_controller], signals=(signal.SIGTERM,))
        self.write("rc", "%d\n" % rc)
        return rc

    def started(self):
        self.write("pid", "%d %d\n" % (os.getpid(), os.getpid()))


def main(argv):
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "stream" and len(argv) == 5 and argv[3].isdigit() and argv[4].isdigit():
        return Stream(argv[2], int(argv[3]), int(argv[4])).stream()
    if mode == "stacks" and len(argv) == 3:
        return stacks(json.loads(argv[2]))
    if mode == "container" and len(argv) > 5:
        return container(argv[2], argv[3], argv[4:])
    if mode == "probe" and len(argv) == 3:
        return probe(json.loads(argv[2]))
    if mode == "stop-run" and len(argv) == 7 and all(a.isdigit() for a in argv[3:6]):
        return stop_run(argv[2], int(argv[3]), int(argv[4]), int(argv[5]), argv[6])
    if mode == "attach" and len(argv) == 6 and all(a.isdigit() for a in argv[3:]):
        return attach(argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
    if (mode, len(argv)) not in (("node", 3), ("run", 3), ("supervise", 4)):
        say(
            "%susage: node_run node PLAN_JSON | node_run run PLAN_JSON | node_run supervise PLAN_JSON RUN_DIR | "
            "node_run stream RUN_DIR PID OFFSET | node_run attach JOB ATTEMPT RANK OFFSET | "
            "node_run stop-run JOB ATTEMPT RANK TICKS SECONDS | node_run probe CHECKS_JSON" % ERROR_PREFIX
        )
        return 2
    try:
        plan = json.loads(argv[2])
    except ValueError as e:
        say("%sthe node's plan is not JSON (%s): launch again" % (ERROR_PREFIX, e))
        return 2
    if plan.get("schema") != SCHEMA:
        say("%sthe node's plan is schema %r; this node program reads %d" % (ERROR_PREFIX, plan.get("schema"), SCHEMA))
        return 2
    try:
        run = Supervised(plan, argv[3]) if mode == "supervise" else Run(plan)
    except (KeyError, TypeError, ValueError, StopIteration) as e:
        say("%sthe node's plan lacks its run half (%s: %s); launch again" % (ERROR_PREFIX, type(e).__name__, e))
        return 2
    if mode == "supervise":
        return run.supervise()
    if mode == "node":
        return node(plan, run)
    rc = run.run([run.watch_stdin])
    say("%s %d" % (EXIT_MARKER, rc))
    return rc


def ended_by(signum, frame):
    raise SystemExit(128 + signum)


def node(plan, run):
    """A launch's whole part on this node: launcher.core.node_start's prologue, environment,
    checks, gate and prepare, then the run: under this session (`run`), or, for a detached job
    (the plan's controller grace), a supervisor this session streams. The job's hold on the node
    goes when this program ends, as a SIGHUP or SIGTERM before the run ends it."""
    start = Start(plan, sys.stdin.buffer)
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, ended_by)
    try:
        try:
            start.start()
        except Ended as e:
            return e.rc
        if plan["limits"]["controller_grace_s"] is not None:
            return supervised_session(plan)
        rc = run.run([run.watch_stdin])
        say("%s %d" % (EXIT_MARKER, rc))
        return rc
    finally:
        start.release()


def run_dir(job, attempt, rank):
    """A detached run's directory on this node (launcher.core.supervise.node_run_dir)."""
    return home(os.path.join(NODE_RUNS_DIR, job, "%d.%d" % (int(attempt), int(rank))))


def attach(job, attempt, rank, offset):
    """A re-adopting controller's session (launcher.core.supervise): it answers its check at once
    when the run's directory is there (else one line, exit 3), waits for `go`, then streams from
    byte `offset` as the first session did."""
    d = run_dir(job, attempt, rank)
    try:
        with open(os.path.join(d, "pid")) as f:
            sup = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        os.write(
            2,
            (
                "no run of job %s (attempt %d) on %s: it ended and its output was read, or it never started\n"
                % (job, attempt, socket.gethostname())
            ).encode(),
        )
        return 3
    say(CHECKED_MARKER)
    if sys.stdin.buffer.readline() != GO:
        return 0
    return Stream(d, sup, offset).stream()


def probe(spec):
    """`launch hosts`' program and a launch's question of where its nodes sit (launcher.core.
    program.probe_script): `spec`'s checks answered as a launch's node answers them, then
    CHECKED_MARKER, then the end of input awaited, as a launch's node awaits `go`."""
    try:
        Start(spec, sys.stdin.buffer).checks()
    except Ended as e:
        return e.rc
    say(CHECKED_MARKER)
    sys.stdin.buffer.readline()
    return 0


def stop_run(job, attempt, rank, ticks, seconds):
    """A detached run stopped without a session streaming it (launcher.jobs.adopt): the stop
    request its supervisor reads (`stop`: TICKS SECONDS, a SIGUSR1 to wake it), up to the grace
    and a minute for it to end, then the run's directory removed. Nothing there: nothing to do."""
    d = run_dir(job, attempt, rank)
    if not os.path.isfile(os.path.join(d, "pid")):
        return 0
    try:
        with open(os.path.join(d, "stop.new"), "w") as f:
            f.write("%d %s\n" % (ticks, seconds))
        os.replace(os.path.join(d, "stop.new"), os.path.join(d, "stop"))
        with open(os.path.join(d, "pid")) as f:
            os.kill(int(f.read().split()[1]), signal.SIGUSR1)
    except (OSError, ValueError, IndexError):
        pass  # the watcher finds the file within a second, or has ended already
    deadline = time.monotonic() + float(seconds) + 60
    while not os.path.exists(os.path.join(d, "rc")) and time.monotonic() < deadline:
        time.sleep(0.2)
    shutil.rmtree(d, ignore_errors=True)
    return 0


def supervised_session(plan):
    """A detached job's run (launcher.core.supervise): its directory made (private), the
    supervisor (this program's `supervise`) started in a session of its own with its output
    appended to `out` (it inherits the rendezvous lock, which this session lets go), then this
    session streams `out` from its start."""
    d = run_dir(plan["job_id"], plan["attempt"], plan["node_rank"])
    old = os.umask(0o077)
    try:
        os.makedirs(d, exist_ok=True)
        for name in ("rc", "stop"):
            if os.path.lexists(os.path.join(d, name)):
                os.unlink(os.path.join(d, name))
        out = os.open(
            os.path.join(d, "out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW, 0o600
        )
    except OSError:
        os.write(2, ("cannot create the run directory %s\n" % d).encode())
        return 70
    finally:
        os.umask(old)
    try:
        os.fstat(LOCK_FD)
        keep = (LOCK_FD,)
    except OSError:
        keep = ()
    sup = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", own_source(), "supervise", json.dumps(plan), d],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        pass_fds=keep,
    )
    os.close(out)
    for fd in keep:
        os.close(fd)
    return Stream(d, sup.pid, 0).stream()


def runtime():
    """The container runtime's command on this node: GPUFLEET_CONTAINER_RUNTIME's words if set,
    else docker when its daemon answers on its socket (through `sudo -n -E` when the socket is
    not writable: on COS and with Ubuntu's docker.io it is root's), else podman; None without."""
    named = os.environ.get(RUNTIME_ENV, "").split()
    if named:
        return named
    remote = bool(os.environ.get("DOCKER_HOST"))
    sock = "/var/run/docker.sock"
    if shutil.which("docker") and (remote or os.path.exists(sock)):
        return ["docker"] if remote or os.access(sock, os.W_OK) else ["sudo", "-n", "-E", "docker"]
    return ["podman"] if shutil.which("podman") else None


def container(name, gpus, args):
    """`container NAME GPUS [FLAG VALUE]... IMAGE COMMAND...` (launcher.core.container): the
    rank command in the image, as container NAME, under the launching account's uid, in the
    current directory mounted at its own path; with GPUS `all`, every GPU through the runtime;
    the account's local directory and its variables where the node has them. It waits for the
    runtime's client, taking no SIGTERM, SIGINT or SIGHUP (the stop signals the ranks inside
    themselves), and removes the container when a signal ended the client or a stop reached the
    run: every way out leaves no container."""
    rt = runtime()
    if rt is None:
        say_err(
            "%sno container runtime on %s: neither docker with its daemon running nor podman; install one (the "
            "startup script installs docker) or drop --image" % (ERROR_PREFIX, socket.gethostname())
        )
        return 127
    here = os.environ.get("PWD") or ""
    if not here or not os.path.isdir(here) or not os.path.samefile(here, "."):
        here = os.getcwd()
    pre = []
    if os.environ.get(LOCAL_DIR_VAR):
        pre += ["--mount", "type=bind,src=%s,dst=%s" % (os.environ[LOCAL_DIR_VAR], os.environ[LOCAL_DIR_VAR])]
    pre += [a for v in NODE_LOCAL_VARS if os.environ.get(v) for a in ("-e", v)]
    if gpus == "all":
        pre += ["--gpus", "all"] if any("docker" in w for w in rt) else ["--device", "nvidia.com/gpu=all"]
    user = "%d:%d" % (os.getuid(), os.getgid())
    run = ["run", "--rm", "--name", name, "--user", user, "--mount", "type=bind,src=%s,dst=%s" % (here, here)]
    stopped = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stopped.append(signum))
    try:
        client = subprocess.Popen(rt + run + ["-w", here] + pre + list(args), stdin=subprocess.DEVNULL)
    except OSError as e:
        say_err("%sfailed to execute %s: %s" % (ERROR_PREFIX, rt[0], e.strerror))
        return 127
    rc = client.wait()  # waited on again after each signal (PEP 475)
    rc = 128 - rc if rc < 0 else rc
    if rc > 128 or stopped:  # a client a signal ended may have left its container (--rm did not run)
        subprocess.run(
            rt + ["rm", "-f", name], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    return rc


def say_err(line):
    try:
        os.write(2, (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def own_source():
    """This program's code: the `-c` argument it was started with."""
    with open("/proc/self/cmdline", "rb") as f:
        args = f.read().split(bytes(1))
    return args[args.index(b"-c") + 1].decode("utf-8", "surrogateescape")


STACK_MARKER = "__GPUFLEET_STACK__"  # launcher.core.stacks's markers
FR_MARKER = "__GPUFLEET_FR__"
NO_PYSPY = "__GPUFLEET_NO_PYSPY__"
STACKS_END = "__GPUFLEET_STACKS_END__"


def find_pyspy(spec):
    """py-spy beside the nodes' python (the one the launch's PATH, read from stdin, puts first),
    else the tools environment's under $HOME, else on PATH; None when there is none."""
    path = os.environ.get("PATH", "")
    if spec["read_path"]:
        line = sys.stdin.buffer.readline()
        if not line.endswith(b"\n"):
            return None, False  # the launcher gave up before sending it
        value = unescape(line[:-1].decode("utf-8", "surrogateescape"))
        path = value + (":" + path if path else "")
    python = shutil.which(spec["python"], path=path)
    beside = os.path.join(os.path.dirname(python), "py-spy") if python else ""
    tools = os.path.join(os.path.expanduser("~"), spec["tools"], "bin", "py-spy")
    for candidate in (beside, tools):
        if candidate and os.access(candidate, os.X_OK) and os.path.isfile(candidate):
            return candidate, True
    return shutil.which("py-spy", path=path), True


def dump(prefix, pid):
    """(status, stdout, stderr) of one py-spy dump; a main thread outside torch.distributed's
    Python is dumped again with --native (a rank in `work.wait()` shows only its caller's line)."""
    first = subprocess.run(prefix + ["--pid", str(pid)], capture_output=True, stdin=subprocess.DEVNULL)
    if first.returncode != 0:
        return first.returncode, first.stdout, first.stderr
    lines = first.stdout.decode("utf-8", "replace").splitlines()
    main = next((i for i, ln in enumerate(lines) if '"MainThread"' in ln), None)
    top = next((ln for ln in lines[main + 1 :] if ln.startswith(" ")), "") if main is not None else ""
    if "torch/distributed/" not in top:
        native = subprocess.run(prefix + ["--native", "--pid", str(pid)], capture_output=True, stdin=subprocess.DEVNULL)
        if native.returncode == 0:
            return 0, native.stdout, b""
    return 0, first.stdout, first.stderr


def flight_recorder_ask(prefix):
    """Ask every rank of the node to write its flight-recorder dump (a byte into its pipe); the
    number asked. A pipe without a reader (its rank is gone) is passed over."""
    asked = 0
    for pipe in sorted(glob.glob(glob.escape(prefix) + "*.pipe")):
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(fd, b"1")
            asked += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def flight_recorder_fetch(prefix, asked):
    """Each dump (`<prefix><rank>`, a regular file) as one base64 line, then removed; up to 5 s for
    the `asked` ones to appear."""

    def dumps():
        return [f for f in glob.glob(glob.escape(prefix) + "[0-9]*") if os.path.isfile(f)]

    for _ in range(25):
        if not asked or len(dumps()) >= asked:
            break
        time.sleep(0.2)
    if asked:
        time.sleep(0.5)
    for f in sorted(dumps()):
        try:
            with open(f, "rb") as fh:
                data = base64.b64encode(fh.read()).decode()
            os.unlink(f)
        except OSError:
            continue
        say("%s %s %s" % (FR_MARKER, f[len(prefix) :], data))


def can_sudo():
    """Whether passwordless sudo works here (an image without sudo: no)."""
    try:
        return subprocess.run(["sudo", "-n", "true"], capture_output=True, stdin=subprocess.DEVNULL).returncode == 0
    except OSError:
        return False


def stacks(spec):
    """`stacks SPEC`: every worker of the run (`token`) on this node dumped with py-spy at once,
    each as `STACK_MARKER rank pid status` then its dump (its error first when it failed), then
    the flight-recorder dumps when `fr_prefix` is set, then STACKS_END (launcher.core.stacks reads it)."""
    pyspy, ok = find_pyspy(spec)
    if not ok:
        return 0
    if pyspy is None:
        say(NO_PYSPY)
        return 0
    workers = ranks(spec["token"], None, anywhere=True)
    sudo = []
    if os.geteuid() != 0 and can_sudo():
        sudo = ["sudo", "-n"]  # ptrace as another user is refused under Yama's ptrace_scope 1
    prefix = sudo + ["timeout", str(spec["timeout"]), pyspy, "dump"]
    asked = flight_recorder_ask(spec["fr_prefix"]) if spec.get("fr_prefix") else 0
    results = {}

    def one(pid):
        try:
            results[pid] = dump(prefix, pid)
        except OSError as e:
            results[pid] = (127, b"", ("Error: %s\n" % e).encode())

    threads = [threading.Thread(target=one, args=(pid,)) for pid, _ in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pid, rank in workers:
        rc, out, err = results.get(pid, (255, b"", b""))
        say("%s %s %d %d" % (STACK_MARKER, rank, pid, rc))
        text = out if rc == 0 else err + out
        try:
            os.write(1, text)
        except OSError:
            pass
    if spec.get("fr_prefix"):
        flight_recorder_fetch(spec["fr_prefix"], asked)
    say(STACKS_END)
    return 0


class Stream:
    """The session's half of a detached run (launcher.core.supervise): the supervisor's output,
    `out` in the run's directory `run_dir`, to this session's stdout from byte `offset`, while
    the supervisor (pid `supervisor`) runs, holding a shared flock(2) on `attached` (the
    supervisor's sign that a controller is there). The session's stdin relays a stop: a `term
    TICKS SECONDS` line becomes the file `stop` and a SIGUSR1 to the supervisor's watcher (the
    second pid of `pid`); its end without one is a detach, and the session leaves the run
    alone. Once the supervisor has ended: the rest of `out`, `EXIT_MARKER <rc>`, and the run's
    directory removed, its output read."""

    def __init__(self, run_dir, supervisor, offset):
        self.dir, self.sup, self.offset = run_dir, supervisor, offset
        self.term = False
        self.detach = threading.Event()

    def path(self, name):
        return os.path.join(self.dir, name)

    def relay(self):
        for raw in sys.stdin.buffer:
            words = raw.decode("utf-8", "replace").split()
            if len(words) != 3 or words[0] != "term":
                continue
            self.term = True
            try:
                with open(self.path("stop.new"), "w") as f:
                    f.write("%s %s\n" % (words[1], words[2]))
                os.replace(self.path("stop.new"), self.path("stop"))
                with open(self.path("pid")) as f:
                    os.kill(int(f.read().split()[1]), signal.SIGUSR1)
            except (OSError, ValueError, IndexError):
                pass  # the watcher finds the file within a second, or has ended already
        if not self.term:
            self.detach.set()

    def copy(self, f):
        """What `out` holds past where `f` is, to stdout; False once nobody reads it."""
        while True:
            chunk = f.read(1 << 16)
            if not chunk:
                return True
            try:
                while chunk:
                    chunk = chunk[os.write(1, chunk) :]
            except OSError:
                return False

    def stream(self):
        try:
            lock = os.open(self.path("attached"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            fcntl.flock(lock, fcntl.LOCK_SH)
            f = open(self.path("out"), "rb")
        except OSError as e:
            os.write(2, ("cannot read the run's output in %s: %s\n" % (self.dir, e.strerror or e)).encode())
            return 70
        threading.Thread(target=self.relay, daemon=True).start()
        with f:
            f.seek(self.offset)
            while True:
                ended = gone(self.sup)  # before the read: the read after it ended takes the rest
                if not self.copy(f):
                    return 0
                if ended:
                    break
                if not self.detach.wait(0.2):
                    continue
                if not os.path.exists(self.path("rc")):
                    return 0  # the controller went away: the run goes on without this session
                time.sleep(0.05)  # the supervisor has written its status and is ending
        try:
            with open(self.path("rc")) as r:
                rc = int(r.read().split()[0])
        except (OSError, ValueError, IndexError):
            if self.detach.is_set():
                return 0
            os.write(2, b"the supervisor of this run ended without an exit status\n")
            return 70
        say("%s %d" % (EXIT_MARKER, rc))
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.dir))  # the job's, once its last run is read
        except OSError:
            pass
        return rc


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    os._exit(code)
