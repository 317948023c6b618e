"""A node's part of a launch up to its run, in Python, from the node's typed plan
(gpufleet.node_plan): what the node program's shell did before (docs/design-node-program.md, "The
typed plan"). It travels with launcher.core.node_run, in one source (`node_run node PLAN`): a node
has nothing of gpufleet installed, so standard library only, Python 3.8 or newer.

In the order it runs (`start`):

1. prologue: the plan's `prologue` steps. `hold`: the job's hold on the node, registered in the
   node's holds registry (launcher.core.holds has the layout and why each rule), removed when this
   program ends, and every live hold of another account printed as `hold.N=` check facts with
   this launch's own `hold_since=`. `authorize`: the cluster key's line added to this account's
   authorized_keys (a detached job's check), once;
2. environment: the plan's variables, in order: the launch's own values (a PATH-like one before
   the node's value), the --env values read from stdin (launcher.core.wire.env_block: their
   values are in no command line), the host NIC resolved here for a variable the catalog cannot
   fill. End of input before a value: nothing ran, exit 0;
3. checks: `key=value` lines the launcher compares across nodes (hostname, clock, ready marker,
   torch version, --workdir, Spot, GPUs, NICs, RxDM), and node 0's lock on the rendezvous port
   (fd 9, held by the run until it ends; busy: `port=busy:JOB`, exit 75);
4. gate: CHECKED_MARKER, then one line on stdin: `go` goes on, anything else (end of input: a
   node failed its check, or Ctrl-C) ends the program with nothing run;
5. prepare: `cd --workdir`, each path the launch prepared (missing: one line, exit 71), the
   account's local directory (the local checkpoint tier, the compile caches), the flight
   recorder's older names for a torch 2.4-2.7.

The lines the launcher reads are the ones the shell printed, so launcher.core.session and
launcher.health read them unchanged. Names shared with the launcher are repeated here (this runs
without gpufleet); tests/launcher/test_node_start.py holds them equal.
"""

import fcntl
import os
import pwd
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.request
from stat import S_IMODE, S_ISDIR

CHECKED_MARKER = "__GPUFLEET_CHECKED__"  # launcher.core.wire
GO = b"go\n"
RUN_VAR = "GPUFLEET_RUN"  # set on the workload alone (launcher.core.node_run)
ERROR_PREFIX = "gpufleet: "  # gpufleet.contracts.LAUNCHER_ERROR_PREFIX
READY_MARKER = "/var/lib/gpufleet/ready.json"  # gpufleet.contracts
HOLDS_DIRS = ("/run/gpufleet-holds", "/tmp")  # launcher.core.holds.HOLDS_DIRS
HOLD_PREFIX = "gpufleet-hold."
GPU_QUERY = (  # gpufleet.health.GPU_QUERY_FIELDS
    "index,name,uuid,pci.bus_id,memory.total,driver_version,persistence_mode,"
    "ecc.errors.uncorrected.volatile.total,retired_pages.pending,remapped_rows.pending,temperature.gpu,"
    "power.draw,utilization.gpu"
)
LOCAL_SSD_MOUNTS = ("/mnt/localssd", "/mnt/disks/localssd")  # gpufleet.contracts.LOCAL_SSD_MOUNT
LOCAL_SSD_HOOK = "GPUFLEET_LOCAL_SSD_MOUNT"  # the tests' local SSD (launcher.core.node_local)
LOCAL_DIR_VAR = "GPUFLEET_LOCAL_DIR"
LOCAL_CHECKPOINT_VAR = "GPUFLEET_LOCAL_CHECKPOINT_DIR"
COMPILE_CACHES = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))
FR_ALIASES = (  # launcher.core.hang.FR_ALIASES: the names torch 2.4-2.7 read
    ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
)
LOCK_FD = 9  # the rendezvous port's lock, inherited by the run (launcher.core.node_run)
TORCH_VERSION = "import importlib.metadata as m; print(m.version('torch'))"  # no import of torch


class Ended(Exception):
    """The node's part ends before its run: `rc` its status (0: nothing was asked to run)."""

    def __init__(self, rc):
        super().__init__(rc)
        self.rc = rc


def put(line, fd=1):
    """One line on stdout (or `fd`), written whole."""
    try:
        os.write(fd, (line + "\n").encode("utf-8", "surrogateescape"))
    except OSError:
        pass


def refuse(line, rc):
    """A line the launcher reads as this node's own error, on stderr, and the end."""
    put(ERROR_PREFIX + line, 2)
    raise Ended(rc)


def home(path=""):
    return os.path.join(os.path.expanduser("~"), path) if path else os.path.expanduser("~")


def tilde(path):
    """`~/x` is the login directory's x on the node; any other path as it is."""
    return home(path[2:]) if path.startswith("~/") else path


def output(argv, merge=False):
    """(status, stdout) of `argv`; 127 and nothing when it is not installed."""
    try:
        p = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.DEVNULL,
        )
    except OSError:
        return 127, ""
    return p.returncode, p.stdout.decode("utf-8", "replace")


def torch_version(python):
    rc, out = output([python, "-c", TORCH_VERSION])
    return out.strip() if rc == 0 and out.strip() else "missing"


class Start:
    """The node's part before its run, for `plan` (a dict, the plan's JSON), reading `stdin` (a
    binary file: the launcher's --env values, then `go`; the run reads on from the same file)."""

    def __init__(self, plan, stdin):
        self.plan, self.stdin = plan, stdin
        self.hold_file = None

    def start(self):
        """Prologue, environment, checks, gate, prepare; Ended when the run must not start."""
        for step in self.plan["prologue"]:
            if step["kind"] == "hold":
                self.hold(step["value"].split(","))
            elif step["kind"] == "authorize":
                authorize(step["value"])
        self.environment()
        self.checks()
        put(CHECKED_MARKER)
        if self.stdin.readline() != GO:
            raise Ended(0)
        self.prepare()

    def release(self):
        """The hold goes when the program ends (a job killed before this runs holds nothing:
        its pid is gone)."""
        if self.hold_file is not None:
            try:
                os.unlink(self.hold_file)
            except OSError:
                pass
            self.hold_file = None

    # -- prologue --------------------------------------------------------------------------

    def hold(self, hosts, dirs=HOLDS_DIRS):
        """Register the job in the registry (the first of `dirs` fit for it: `holds_dir`), print
        the other accounts' live holds, and remove this account's own whose program is gone."""
        d = holds_dir(dirs)
        if d is None:
            return
        uid = os.getuid()
        mine = HOLD_PREFIX + "%d." % uid
        for name in sorted(os.listdir(d)):  # this account's holds whose program is gone
            if name.startswith(mine) and hold_live(os.path.join(d, name)) is None:
                try:
                    os.unlink(os.path.join(d, name))
                except OSError:
                    pass
        path = os.path.join(d, mine + self.plan["job_id"])
        since = "%.9f" % time.time()
        try:
            account = pwd.getpwuid(uid).pw_name
        except KeyError:
            account = str(uid)
        line = "v1 %s %d %s %s %d %s %s\n" % (
            account, uid, self.plan["job_id"], since, os.getpid(), start_time(os.getpid()), ",".join(hosts) or "-"
        )  # fmt: skip
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            os.fchmod(fd, 0o644)  # readable by every account, whatever the umask
            os.write(fd, line.encode())
            os.close(fd)
            self.hold_file = path
            put("hold_since=" + since)
        except OSError:
            pass  # a file of this name is there already: the launcher counts every hold as older
        n = 0
        for name in sorted(os.listdir(d)):
            other = os.path.join(d, name)
            live = hold_live(other) if name.startswith(HOLD_PREFIX) and other != path else None
            if live is not None and live[1] != uid:
                n += 1
                f = live[0]
                put("hold.%d=%s %s %s %s" % (n, f[1], f[3], f[4], f[7]))

    # -- environment -----------------------------------------------------------------------

    def environment(self):
        unresolved = []
        for v in self.plan["env"]:
            name = v["name"]
            if name == RUN_VAR:
                continue  # the workload's alone: every process with it is the run's
            if v["source"] == "node":
                unresolved.append(name)
                continue
            if v["source"] == "stdin":
                line = self.stdin.readline()
                if not line.endswith(b"\n"):
                    raise Ended(0)  # the launcher gave up before sending it
                value = unescape(line[:-1].decode("utf-8", "surrogateescape"))
            else:
                value = v["value"] or ""
            if v["prepend"] and os.environ.get(name):
                value += ":" + os.environ[name]
            os.environ[name] = value
        if unresolved:
            iface = host_iface(self.plan["address"], self.plan.get("head_address") or self.plan["address"])
            for name in unresolved if iface else ():
                os.environ[name] = iface

    # -- checks ----------------------------------------------------------------------------

    def checks(self):
        gpus, hardware = None, False
        for check in self.plan["checks"]:
            kind, target = check["kind"], check["target"]
            if kind == "node-facts":
                put("host=" + socket.gethostname())
                put("time=%.9f" % time.time())
                put("ready=" + ("yes" if os.path.isfile(READY_MARKER) else "no"))
            elif kind == "torch-version":
                put("torch=" + torch_version(target))
            elif kind == "workdir":
                put("workdir=" + ("ok" if os.path.isdir(tilde(target)) else "missing"))
            elif kind == "preemptible":
                rc, value = metadata("instance/scheduling/preemptible")
                put("preemptible=" + (value if rc == 0 else "unknown"))
            elif kind == "gpus":
                gpus, hardware = nvidia_smi(), True  # asked first, read last: it overlaps the rest
            elif kind == "nic":
                put(nic_line(target))
            elif kind == "rxdm":
                put_rxdm(target)
            elif kind == "rdzv-port":
                self.lock_port(int(target))
            elif kind == "physical-host":
                put_physical_host()
        if hardware:
            put_gpus(gpus)

    def lock_port(self, port):
        """Held from the check to the end of the run (it inherits fd 9), so no other launch slips
        in between "free" and "taken"; the file is private (0600, in ~/.gpufleet)."""
        path = home(".gpufleet/rdzv-%s-%d.lock" % (self.plan["address"], port))
        old = os.umask(0o077)
        try:
            os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            refuse("cannot take the rendezvous port's lock %s on %s: %s" % (path, self.plan["host"], e.strerror), 70)
        finally:
            os.umask(old)
        os.dup2(fd, LOCK_FD)
        os.close(fd)
        try:
            fcntl.flock(LOCK_FD, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                with open(path + ".job") as f:
                    holder = f.read().strip()
            except OSError:
                holder = ""
            put("port=busy:" + holder)
            put(CHECKED_MARKER)
            raise Ended(75) from None
        old = os.umask(0o077)
        try:
            with open(path + ".job", "w") as f:
                f.write(self.plan["job_id"] + "\n")
        finally:
            os.umask(old)
        put("port=free")

    # -- prepare ---------------------------------------------------------------------------

    def prepare(self):
        host = self.plan["host"]
        for step in self.plan["prepare"]:
            kind, path = step["kind"], step["path"]
            if kind == "workdir":
                try:
                    os.chdir(tilde(path))
                except OSError:
                    refuse("--workdir %s does not exist on %s" % (shlex.quote(path), host), 71)
                # As a shell's cd sets it: the path as named (a container mounts it there).
                os.environ["PWD"] = os.path.normpath(tilde(path)) if tilde(path).startswith("/") else os.getcwd()
            elif kind in ("code", "directory", "environment", "prepared"):
                if not os.path.exists(path):
                    refuse(
                        "%s lacks %s, which the launch prepared for this job (did the node lose its disk?); "
                        "launch the job again" % (host, shlex.quote(path)),
                        71,
                    )
            elif kind == "local-dir":
                local_dir(path)
            elif kind == "fr-aliases":
                if torch_version(path).split(".")[:2] in (["2", "4"], ["2", "5"], ["2", "6"], ["2", "7"]):
                    for new, old in FR_ALIASES:
                        if new in os.environ:
                            os.environ[old] = os.environ[new]


def unescape(line):
    """One launcher.core.wire.env_block line, decoded: a backslash and `n` a newline, two
    backslashes one."""
    escape = chr(92)  # no literal backslash in what travels on a shell line
    out, i = [], 0
    while i < len(line):
        if line[i] == escape and i + 1 < len(line) and line[i + 1] in ("n", escape):
            out.append(chr(10) if line[i + 1] == "n" else escape)
            i += 2
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def host_iface(address, head):
    """The interface that holds `address` (how the launcher reaches this node); failing that
    (it connected by name), the one the route to node 0 (`head`) leaves through; "" if neither."""
    for line in output(["ip", "-o", "-4", "addr", "show"])[1].splitlines():
        f = line.split()
        if len(f) > 3 and f[3].split("/")[0] == address:
            return f[1]
    words = output(["ip", "-o", "route", "get", head])[1].split()
    devs = [i for i, w in enumerate(words) if w == "dev" and i + 1 < len(words)]
    return words[devs[-1] + 1] if devs else ""


def metadata(key):
    """(status, value) of the metadata server's `key` (https://cloud.google.com/compute/docs/
    metadata/predefined-metadata-keys; GCE_METADATA_HOST names another server), the status as
    curl's that the launcher reads (launcher.cluster.topology): 0 answered, 22 an error status
    (the 404 of a key the VM does not have), 28 no answer within 2 s, 7 no server."""
    url = "http://%s/computeMetadata/v1/%s" % (os.environ.get("GCE_METADATA_HOST") or "metadata.google.internal", key)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers={"Metadata-Flavor": "Google"}), timeout=2) as r:
            return 0, r.read().decode("utf-8", "replace").strip()
    except urllib.error.HTTPError:
        return 22, ""
    except socket.timeout:
        return 28, ""
    except Exception:  # noqa: BLE001 -- no server to ask (not on Compute Engine)
        return 7, ""


def put_physical_host():
    """`metadata_rc=` and `physical_host=`: where the VM sits (instance/attributes/physical_host,
    https://cloud.google.com/compute/docs/instances/use-compact-placement-policies)."""
    rc, value = metadata("instance/attributes/physical_host")
    put("metadata_rc=%d" % rc)
    put("physical_host=" + value)


def nvidia_smi():
    """nvidia-smi's documented CSV query, started (its output read by `put_gpus`), or None."""
    argv = ["nvidia-smi", "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits"]
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError:
        return None


def put_gpus(smi):
    """`smi_rc=` (127: no nvidia-smi) and one `gpu.N=` line per line it printed (its reason for
    failing, when it did)."""
    if smi is None:
        put("smi_rc=127")
        put("gpu.0=nvidia-smi: command not found")
        return
    out = smi.communicate()[0].decode("utf-8", "replace")
    put("smi_rc=%d" % smi.returncode)
    for n, line in enumerate(x for x in out.splitlines() if x.strip()):
        put("gpu.%d=%s" % (n, line))


def nic_line(name):
    """`nic.NAME=<operstate> <mtu> <flags>` from /sys/class/net, or `nic.NAME=missing`."""
    d = os.path.join("/sys/class/net", name)
    if not os.path.exists(d):
        return "nic.%s=missing" % name
    values = []
    for f in ("operstate", "mtu", "flags"):
        try:
            with open(os.path.join(d, f)) as fh:
                values.append(fh.readline().strip())
        except OSError:
            values.append("")
    return "nic.%s=%s" % (name, " ".join(values))


def put_rxdm(container):
    """`rxdm_rc=` (docker's status; 127: no docker) and `rxdm=` (the running container's id),
    asking docker as this account, else through `sudo -n` (the socket is root's on COS)."""
    query = ["docker", "ps", "-q", "-f", "name=^%s$" % container]  # running containers only
    rc, out = output(query, merge=True)
    if rc != 0:
        rc2, out2 = output(["sudo", "-n", *query])
        if rc2 == 0:
            rc, out = 0, out2
    put("rxdm_rc=%d" % rc)
    put("rxdm=" + (out.splitlines()[0] if out.strip() else ""))


def authorize(entry):
    """`entry` in ~/.ssh/authorized_keys, once (0600 in a 0700 ~/.ssh)."""
    old = os.umask(0o077)
    try:
        os.makedirs(home(".ssh"), 0o700, exist_ok=True)
        fd = os.open(home(".ssh/authorized_keys"), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+") as f:
            if entry not in f.read().splitlines():
                f.write(entry + "\n")
    except OSError:
        pass  # the detach's own check finds the key unusable and says so
    finally:
        os.umask(old)


def holds_dir(dirs):
    """The registry: the first of `dirs` that is root's, 1777 and not a link; None without one."""
    for d in dirs:
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if S_ISDIR(st.st_mode) and st.st_uid == 0 and S_IMODE(st.st_mode) == 0o1777:
            return d
    return None


def start_time(pid):
    """Field 22 of /proc/PID/stat (its start time), or None."""
    s = proc_stat(pid)
    return None if s is None else s[1]


def proc_stat(pid):
    """(state, start time) of `pid` from /proc/PID/stat (after its `(comm) `), or None."""
    try:
        with open("/proc/%s/stat" % pid, "rb") as f:
            fields = f.read().rpartition(b") ")[2].split()
        return fields[0].decode(), fields[19].decode()
    except (OSError, IndexError, ValueError):
        return None


def hold_live(path):
    """(its fields, its file's owner) when the hold in `path` is believed: its owner is the UID
    it names, and its program runs with the start time it names and is no zombie; else None."""
    try:
        st = os.lstat(path)
        with open(path) as f:
            fields = f.readline().split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(fields) < 8 or fields[0] != "v1" or str(st.st_uid) != fields[2]:
        return None
    s = proc_stat(fields[5]) if fields[5].isdigit() else None
    if s is None or s[0] == "Z" or s[1] != fields[6]:
        return None
    return fields, st.st_uid


def local_dir(key):
    """GPUFLEET_LOCAL_DIR, the local checkpoint tier and the compile caches (keyed by `key`: the
    job's environment), each exported unless --env set it: MOUNT/gpufleet-UID on a mounted,
    writable local SSD, else ~/.gpufleet/local; only a 0700 directory of this account's own (one
    on the SSD that is not: a warning, and the boot disk). None to be had: nothing exported (a run
    that needs the tier then refuses with one line)."""
    hook = os.environ.get(LOCAL_SSD_HOOK)
    uid, found = os.getuid(), ""
    for mount in (hook,) if hook else LOCAL_SSD_MOUNTS:
        if os.path.ismount(mount) and os.access(mount, os.W_OK):
            d = os.path.join(mount, "gpufleet-%d" % uid)
            if private(d):
                found = d
            else:
                put(
                    "warning: not using %s on the local SSD: it is not a 0700 directory of this account's own; "
                    "remove it (the boot disk is used meanwhile)" % d,
                    2,
                )
            break
    if not found and private(home(".gpufleet")) and private(home(".gpufleet/local")):
        found = home(".gpufleet/local")
    if not found:
        return
    os.environ[LOCAL_DIR_VAR] = found
    old = os.umask(0o077)
    try:
        os.makedirs(os.path.join(found, "compile", key), exist_ok=True)
    except OSError:
        pass
    finally:
        os.umask(old)
    defaults = [(LOCAL_CHECKPOINT_VAR, os.path.join(found, "checkpoints"))]
    defaults += [(var, os.path.join(found, "compile", key, sub)) for var, sub in COMPILE_CACHES]
    for var, value in defaults:
        if not os.environ.get(var):  # --env's own value wins
            os.environ[var] = value


def private(d):
    """`d` made 0700 if missing, then checked: a directory, not a link, this account's, writable
    by no other account, writable here."""
    try:
        os.mkdir(d, 0o700)
    except OSError:
        pass
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return (
        S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not S_IMODE(st.st_mode) & 0o022 and os.access(d, os.W_OK)
    )
