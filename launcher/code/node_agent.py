"""The node side of a launch's preparation: one self-contained, standard-library-only program,
sent as its source text (`python3 -I -S -c SOURCE COMMAND`), since a bare node has nothing of
gpufleet yet. The launcher side is launcher.code.prepare; the layout under ~/.gpufleet:

    objects/SHA256        every file's content, once per node (content-addressed); this
                          program's own source too (the relay key's forced command runs it)
    relay/PID/            the relay key and known_hosts while a relay (or a tree launch) passes on
    tree/CLUSTER--ADDR    this node's launch key for a cluster (launcher.code.launch_tree), 0600
    tree/seen/NONCE       each launch part's nonce once run (a replay is refused; kept a day)
    replica/CLUSTER/      the cluster's replica key and known_hosts, for a --recover job's
                          checkpoint copies to a peer node (gpufleet.replica; launcher.code.tree)
    snap/HASH/            a snapshot of gpufleet's own code (gpufleet/, workloads/), by content
    work/JOB/             a job's working directory: its --sync snapshot, copied (writes allowed)
    envs/KEY              a link to envs/KEY-MARK/, the Python environment built with uv, KEY the
                          hash of what defines it, MARK of what the node chose (its torch index,
                          its Python): a changed MARK builds a new directory beside the old one,
                          which a running job goes on using, and the link is swapped by rename
    uv-cache/, pip-cache/ the caches of uv and pip, where the node has no local SSD
    tools/NAME-VERSION/   a tool the job's environment lacks (py-spy, for hang stacks), built the same way
    uv/                   uv itself, where the node had none (pip-installed from the job's index)

~/.gpufleet is made 0700 whatever the umask, and checked before each use: this account's own
directory, not a link, not open to others (the one-line refusal names it and the fix). Where the
node has a local SSD, uv's cache is on it in a directory of this account's own,
MOUNT/gpufleet-UID (0700, checked the same way): never a directory another account could have
made first, whose cache entries uv would install into this account's environment.

Commands (stdin carries the request; every line this program prints starts with PREFIX):
- `prepare`: a JSON request. Reports the objects the node lacks; places every snapshot whose
  objects are all there; builds the environment when it is missing (one build per KEY at a
  time: a file lock), printing progress; then the request's `tools` environment when the job's
  environment lacks its program (a failure there is reported apart: the job can run without
  it). Ends with `PREFIX result JSON`.
- `warm`: a JSON request (`python`, `code`): a spare's environment and gpufleet's code compiled to
  bytecode once, while it waits (a swap onto it then starts as warm as the others). Ends with
  `PREFIX result JSON`.
- `relay PORT PEERS`: a stream of frames (`KEY SIZE`, `KNOWN SIZE`, `FWD SIZE` + a JSON plan, `OBJ SHA
  SIZE`, each followed by SIZE bytes; `END`): stores each object (its hash checked) and passes
  it on, chunk by chunk as it arrives, to each child in the plan that lacks it, over ssh with
  the relay key to that child's own `relay` (a tree: node 0 gets one stream from the launching
  machine, every node passes on to a few others; launcher.code.tree has the plan and why the
  relay key, not the cluster key, travels). Ends with `PREFIX received JSON`: the objects it
  stored and, per rank of its subtree that did not get its content, why.
- `keys`: a JSON request (`slug`, `address`, `key`): this node's launch key for a cluster.
- `tree` (node 0, from the launching machine; on the others the relay key's forced command,
  asked for `tree`): a launch down the tree (`--fanout`). Frames `KEY`/`KNOWN` as for `relay`,
  `CODE SIZE` (the node program's code, once, which the parts name by hash), `PLAN SIZE`
  (this node's entry: its part signed under its launch key, its children's entries nested),
  then `CTL RANK SIZE` (a signed word for a node of its subtree). It runs its own part only
  when the signature, the expiry and the nonce hold, passes each child its entry over ssh
  with the relay key, and sends up `HELLO` first, then for its subtree `OUT RANK SIZE`,
  `ERR RANK SIZE`, `EXIT RANK RC`, and `LOST RANK VIA` (a node it lost, VIA == RANK, or one cut
  off with node VIA). The end of its input ends every program's input below it.
"""

import base64
import collections
import contextlib
import fcntl
import glob
import hashlib
import hmac
import ipaddress
import json
import os
import queue
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.parse

PREFIX = "gpufleet-prepare:"
G = os.path.join(os.path.expanduser("~"), ".gpufleet")
OBJECTS = os.path.join(G, "objects")
DONE = ".gpufleet-complete"  # written last into a built environment (a snapshot is renamed into place whole)
WARMED = ".gpufleet-bytecode"  # written last into an environment `warm` compiled


# A URL's user information (`://USER:PASSWORD@`, `://TOKEN@`), never shown: pip's own rule
# (pip/_internal/utils/misc.py, redact_netloc): a password becomes ****, a lone user name too.
USERINFO = re.compile(r"(?<=://)([^/@\s:\"']+)(:[^/@\s\"']*)?@")


def redact(text):
    """`text` with the credentials of every URL in it replaced by ****."""
    return USERINFO.sub(lambda m: f"{m.group(1)}:****@" if m.group(2) else "****@", text)


class PrivateError(Exception):
    pass


def private_dir(path, fix_mode=True):
    """`path` as a directory of this account's own: made 0700 (the mode given to mkdir, whatever
    the umask), then checked with lstat: a directory, not a link, owned by this account, writable
    by no other. One made by an older gpufleet under umask 022 (readable by others) is made
    private when `fix_mode`. PrivateError, in one line naming the path and the fix, otherwise."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PrivateError(f"{path} is not a directory but a link or file; remove it (gpufleet makes its own)")
    if st.st_uid != os.geteuid():
        raise PrivateError(
            f"{path} belongs to uid {st.st_uid}, not to this account (uid {os.geteuid()}); another account made it "
            "first: have it removed (its content is not to be trusted)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 or (mode & 0o077 and not fix_mode):
        raise PrivateError(
            f"{path} has mode {mode:04o}, open to other accounts; remove what you did not put there and chmod 700 it"
        )
    if mode != 0o700:
        os.chmod(path, 0o700)
    return path


def own_state():
    """~/.gpufleet and its object store, checked (private_dir); everything this program writes is
    private (umask 077): a snapshot's own modes are set on what it places, inside the 0700 tree."""
    os.umask(0o077)
    private_dir(G)
    os.makedirs(OBJECTS, exist_ok=True)


def local_cache(mounts):
    """uv's cache on the first of `mounts` (the local SSD) that is mounted and writable, in a
    directory of this account's own (MOUNT/gpufleet-UID/uv-cache), else ~/.gpufleet/uv-cache.
    A MOUNT/gpufleet-UID that is wrong (another account's, a link, open to others) is never
    used: one progress line says why, and the cache is the home one."""
    for mount in mounts or []:
        if os.path.ismount(mount) and os.access(mount, os.W_OK):
            try:
                base = private_dir(os.path.join(mount, f"gpufleet-{os.geteuid()}"), fix_mode=False)
            except (PrivateError, OSError) as e:
                say("progress", f"not using the local SSD's cache: {e}")
                break
            return os.path.join(base, "uv-cache")
    return os.path.join(G, "uv-cache")


def say(kind, text):
    """One line for the launching machine, credentials redacted (it may be shown, or kept)."""
    sys.stdout.write(f"{PREFIX} {kind} {redact(text)}\n")
    sys.stdout.flush()


def has_object(sha):
    return os.path.exists(os.path.join(OBJECTS, sha))


def place(snap):
    """Materialize a snapshot at ~/.gpufleet/DEST from the store: written aside, then renamed
    (a half-written snapshot is never seen). `copy`: every file its own copy (a job's working
    directory, which the job may write); else hard links to the store (read-only code)."""
    dest = os.path.join(G, snap["dest"])
    if os.path.isdir(dest):  # renamed into place whole: there means complete
        return
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for path, sha, mode in snap["files"]:
        target = os.path.join(tmp, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        src = os.path.join(OBJECTS, sha)
        if snap.get("copy"):
            shutil.copyfile(src, target)
            os.chmod(target, mode)
        else:
            os.link(src, target)
    os.makedirs(tmp, exist_ok=True)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        os.rename(tmp, dest)
    except OSError:  # another launch placed it first
        shutil.rmtree(tmp, ignore_errors=True)


def without_userinfo(url):
    """(`url` without its `USER:PASSWORD@`, a Basic Authorization header for it or None):
    urllib takes no credentials in the host part."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, None
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), auth


def reachable(url):
    """None when `url` (an index or find-links URL) answers, else why not."""
    if not url.startswith(("http://", "https://")):
        return None if os.path.exists(url.removeprefix("file://")) else "no such directory on the node"
    import urllib.error
    import urllib.request  # here, not at the top: a third of the agent's start, which `tree` never needs

    try:
        bare, auth = without_userinfo(url)
        req = urllib.request.Request(bare, method="GET", headers={"Authorization": auth} if auth else {})
        with urllib.request.urlopen(req, timeout=15) as r:
            r.read(1)
        return None
    except urllib.error.HTTPError as e:
        return None if e.code < 500 and e.code != 404 else f"HTTP {e.code}"
    except Exception as e:  # noqa: BLE001 - any failure to connect is the answer
        reason = getattr(e, "reason", e)
        return redact(str(reason)) or type(e).__name__


METADATA_TOKEN = "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token"


def metadata_token():
    """The node's service account's access token from the metadata server, or None off GCE."""
    import urllib.request

    req = urllib.request.Request(METADATA_TOKEN, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())["access_token"]
    except Exception:  # noqa: BLE001 - no metadata server: no token
        return None


def artifact_registry(url):
    """Whether `url` is an Artifact Registry repository's over HTTPS: its host, as URL parsing
    finds it, is a *.pkg.dev name (never a text match: `https://evil.example?.pkg.dev/` is not)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return False
    return parts.scheme == "https" and host.endswith(".pkg.dev")


def credentialed(url, token):
    """An Artifact Registry URL (*.pkg.dev) with the node's token as its password: the form
    Google documents for pip (https://cloud.google.com/artifact-registry/docs/python/authentication,
    user `oauth2accesstoken`). Any other URL, or one that names its own credentials, as it is."""
    if not token or not artifact_registry(url) or urllib.parse.urlsplit(url).username is not None:
        return url
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=f"oauth2accesstoken:{token}@{parts.netloc}"))


def index_env(env, prefix, torch_index=None):
    """The package sources as environment variables (uv's UV_*, pip's PIP_*), never arguments:
    a URL may carry a token, and a process's arguments are world-readable in /proc."""
    urls = [env.get("index_url")] + env.get("extra_index_urls", []) + [torch_index]
    token = metadata_token() if any(u and artifact_registry(u) for u in urls) else None
    out = {}
    if env.get("index_url"):
        out[prefix + "INDEX_URL"] = credentialed(env["index_url"], token)
    extra = ([torch_index] if torch_index else []) + env.get("extra_index_urls", [])
    if extra:  # uv prefers the earlier: the CUDA index of torch goes first
        out[prefix + "EXTRA_INDEX_URL"] = " ".join(credentialed(u, token) for u in extra)
    if env.get("find_links"):
        out[prefix + "FIND_LINKS"] = (" " if prefix == "PIP_" else ",").join(env["find_links"])
    return out


def trusted_hosts(env):
    """The hosts of the plain-HTTP indexes, for PIP_TRUSTED_HOST: the host alone, never a
    URL's user name or password."""
    urls = [env.get("index_url")] + env.get("extra_index_urls", [])
    return [urllib.parse.urlsplit(u).hostname for u in urls if u and u.startswith("http://")]


def find_uv(env):
    """uv on PATH, else the one this program installed before, else pip-install it now from the
    job's own package source (the node ran no startup script that brought one): the version and
    wheel the startup script pins (env["uv"], a requirements line with its hash), so a node gets
    the same uv either way and pip refuses any other file."""
    on_path = shutil.which("uv")
    if on_path:
        return on_path
    home = os.path.join(G, "uv")
    uv = os.path.join(home, "bin", "uv")
    private_dir(G)
    with open(os.path.join(G, "uv.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = os.path.join(home, DONE)
        if os.path.exists(done) and open(done).read() == env["uv"]:
            return uv
        say("progress", "installing uv (pip, from " + (env.get("index_url") or "PyPI") + ")")
        shutil.rmtree(home, ignore_errors=True)
        run([sys.executable, "-m", "venv", home])
        pip_env = dict(os.environ, PIP_CACHE_DIR=os.path.join(G, "pip-cache"), **index_env(env, "PIP_"))
        trusted = trusted_hosts(env)
        if trusted:  # pip takes plain HTTP only from a host named trusted
            pip_env["PIP_TRUSTED_HOST"] = " ".join(trusted)
        req = os.path.join(home, "requirements.txt")
        with open(req, "w") as f:
            f.write(env["uv"] + "\n")
        pip = [os.path.join(home, "bin", "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run(pip + ["--require-hashes", "--only-binary=:all:", "-r", req], env=pip_env)
        with open(done, "w") as f:
            f.write(env["uv"])
    return uv


class BuildError(Exception):
    pass


def run(argv, cwd=None, env=None, on_line=None):
    """Run argv; each stderr/stdout line to on_line; BuildError with the output's tail on failure."""
    p = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    lines = []
    for line in p.stdout:
        line = line.rstrip()
        lines.append(line)
        if on_line and line.strip():
            on_line(line)
    if p.wait() != 0:
        raise BuildError(reason(lines) or f"{os.path.basename(argv[0])} exit {p.returncode}")
    return lines


def reason(lines):
    """The resolver's reason in one line: uv's `Because ...` paragraph (after `╰─▶` on a
    terminal, `cause:` otherwise), pip's `ERROR:` line, else the last line."""
    text = [line.strip() for line in lines if line.strip()]
    for i, line in enumerate(text):
        for mark in ("╰─▶", "cause:"):
            if line.startswith(mark) or mark == "╰─▶" and mark in line:
                rest = [t for t in text[i + 1 :] if not t.startswith(("hint:", "help:", "cause:"))]
                return " ".join([line.split(mark, 1)[1].strip()] + rest)
    errors = [t for t in text if t.startswith(("error:", "ERROR:", "×"))]
    return (errors or text or [""])[-1].lstrip("×").strip()


def torch_marker(env):
    return json.dumps({"torch_index": env.get("torch_index"), "python": sys.version.split()[0]}, sort_keys=True)


def build_env(env, base="envs", what=None):
    """The environment ~/.gpufleet/BASE/KEY-MARK, built with uv unless it is there already, and
    the link BASE/KEY pointed at it; `what`: its progress line. MARK is what the node chose
    (torch_marker): a changed MARK is a new directory, so a job running the old one keeps it
    (`launch prune` removes it once unused). A lock file installs with its hashes, as locked."""
    link = os.path.join(G, base, env["key"])
    d = f"{link}-{hashlib.sha256(torch_marker(env).encode()).hexdigest()[:12]}"
    python = os.path.join(d, "bin", "python")
    done = os.path.join(d, DONE)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    with open(d + ".lock", "w") as lock:  # the lock `launch prune` takes to remove it (node_prune)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(done):
            point(link, d)
            return python, False
        urls = [u for u in [env.get("index_url")] + env.get("extra_index_urls", []) + env.get("find_links", []) if u]
        for url in urls + ([env["torch_index"]] if env.get("torch_index") else []):
            why = reachable(url)
            if why:
                raise BuildError(f"the package index {redact(url)} cannot be reached ({why})")
        uv = find_uv(env)
        say("progress", what or f"building environment {env['key'][:12]}")
        shutil.rmtree(d, ignore_errors=True)  # half-built (DONE is written last): no job ever ran it
        os.makedirs(d)
        uv_env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1")
        uv_env["UV_CACHE_DIR"] = local_cache(env.get("local_ssd"))  # never uv's shared or default one
        run([uv, "venv", "-q", "--python", sys.executable, d], env=uv_env)
        spec_dir = os.path.join(d, ".gpufleet-spec")
        os.makedirs(spec_dir)
        for name, text in env["files"].items():  # requirements.txt, pyproject.toml, uv.lock
            with open(os.path.join(spec_dir, name), "w") as f:
                f.write(text)
        req = os.path.join(spec_dir, env["kind"])
        hashes = []
        if env["kind"] == "uv.lock":  # exported with the lock's hashes, which uv then requires
            req = os.path.join(spec_dir, "requirements.txt")
            run(
                [uv, "export", "-q", "--frozen", "--no-emit-project", "--format", "requirements-txt"]
                + ["--directory", spec_dir, "-o", req],
                env=uv_env,
            )
            hashes = ["--require-hashes"]
        uv_env.update(index_env(env, "UV_", env.get("torch_index")))
        argv = [uv, "pip", "install", "--python", python, *hashes, "-r", req]
        keep = ("Resolved", "Prepared", "Installed", "Downloading", "Audited")
        run(argv, env=uv_env, on_line=lambda line: line.lstrip().startswith(keep) and say("progress", line.strip()))
        with open(done, "w") as f:
            f.write(torch_marker(env))
        point(link, d)
        return python, True


def point(link, target):
    """`link` made to name `target` (a sibling), swapped by rename: a reader sees the old link or
    the new one, never none. A real directory there (built in place by an older gpufleet) is
    left as it is: a job may run it."""
    if os.path.islink(link) and os.readlink(link) == os.path.basename(target):
        return
    tmp = f"{link}.link-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(os.path.basename(target), tmp)
    try:
        os.rename(tmp, link)
    except OSError:
        os.unlink(tmp)


def gpu_driver():
    """The NVIDIA driver version (nvidia-smi), or None on a node without one."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[0] if out else None


def lease_file(path):
    """Where the lease on `path` (under ~/.gpufleet) is kept: the same relative path under
    ~/.gpufleet/leases, so the directories a person looks into hold only what a launch left."""
    return os.path.join(G, "leases", os.path.relpath(path, G))


def lease(path, how=fcntl.LOCK_SH):
    """The lease on `path` (~/.gpufleet/leases/PATH, flock(2)), held until this program ends:
    shared while a launch uses the path, exclusive while `launch prune` removes it
    (node_prune.lease, the same protocol). A lease file a prune removed while this waited is opened again."""
    name = lease_file(path)
    os.makedirs(os.path.dirname(name), exist_ok=True)
    while True:
        fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, how)
        try:
            same = os.fstat(fd).st_ino == os.stat(name).st_ino
        except OSError:
            same = False
        if same:
            return fd
        os.close(fd)


def take_leases(req):
    """Shared leases on everything this request uses (the object store, each snapshot's
    directory, the environment), each marked used now where it exists: a prune that scanned
    before checks its age again under its exclusive lease and keeps it."""
    lease(OBJECTS)
    used = [os.path.join(G, s["dest"]) for s in req.get("snapshots", [])]
    used += [os.path.join(G, "envs", req["env"]["key"])] if req.get("env") else []
    for path in used:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lease(path)
    now = time.time()
    for path in used + [
        os.path.join(OBJECTS, sha) for s in req.get("snapshots", []) for _, sha, _ in s["files"] if SHA.fullmatch(sha)
    ]:
        try:
            os.utime(path, (now, now))
        except OSError:  # not there yet: its objects are still to come
            pass


def prepare(req):
    own_state()
    result = {"home": os.path.expanduser("~"), "missing": [], "python": None, "built": False, "error": None}
    result["agent"] = keep_own_source()
    take_leases(req)
    pending = []
    for snap in req.get("snapshots", []):
        # Every object is reported, placed snapshot or not: node 0 passes them on to the others.
        lacking = sorted({sha for _, sha, _ in snap["files"] if not has_object(sha)})
        result["missing"] += lacking
        if not lacking and not os.path.isdir(os.path.join(G, snap["dest"])):
            pending.append(snap)
    result["missing"] = sorted(set(result["missing"]))
    for snap in pending:
        place(snap)
    if req.get("replica"):
        keep_replica_key(req["replica"])
    env = req.get("env")
    if env:
        driver = gpu_driver()
        result["driver"] = driver
        if driver and env.get("torch_indexes") and env["kind"] != "uv.lock":  # a lock names its own torch
            env["torch_index"] = pick_torch_index(driver, env["torch_indexes"])
        try:
            result["python"], result["built"] = build_env(env)
        except BuildError as e:
            result["error"] = redact(str(e))
    tools = req.get("tools")
    if tools and not result["error"]:
        result["tools_error"] = build_tools(tools, result["python"])
    # What this launch uses, marked used now: `launch prune` (launcher.code.node_prune) removes
    # only what no launch has used for its --older-than.
    used = [os.path.join(G, s["dest"]) for s in req.get("snapshots", [])]
    for path in used + ([os.path.dirname(os.path.dirname(result["python"]))] if env and result["python"] else []):
        try:
            os.utime(path)
        except OSError:  # not placed yet: its objects are still to come
            pass
    say("result", json.dumps(result))


def warm(req):
    """A spare's environment (and gpufleet's code) compiled to bytecode, once: uv installs
    without it, so a spare that never ran its environment would compile every module torch
    imports on its first start, on the swap's critical path (seconds of CPU per rank). The
    other nodes compile theirs as their ranks first import. `python` is the environment's
    interpreter (the link envs/KEY or envs/KEY-MARK), `code` the snapshots' hashes (snap/HASH);
    both must be this account's, under ~/.gpufleet. The marker WARMED, written last, makes
    the next job's warm of the same environment a no-op."""
    own_state()
    venv = os.path.realpath(os.path.dirname(os.path.dirname(req["python"])))
    envs = os.path.realpath(os.path.join(G, "envs"))
    if os.path.dirname(venv) != envs or not os.path.exists(os.path.join(venv, DONE)):
        raise PrivateError(f"{req['python']} is not an environment gpufleet built under {envs}; prepare the node again")
    dirs = sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages")))
    dirs += [os.path.join(G, "snap", h) for h in req.get("code", []) if SNAP.fullmatch(h)]
    lease(os.path.join(G, "envs", os.path.basename(venv).rsplit("-", 1)[0]))  # `launch prune` waits for it
    mark = os.path.join(venv, WARMED)
    if os.path.exists(mark):
        say("result", json.dumps({"compiled": False, "seconds": 0}))
        return
    say("progress", "compiling its environment to bytecode, so that a swap onto it starts warm")
    t0 = time.time()
    # compileall (-j 0: every CPU) writes each module's __pycache__ beside it, as an import
    # would; a file that does not compile (a package's Python 2 template) is left to fail at
    # import, as it would without this. -I: no PYTHON* variable of the account changes it.
    argv = [os.path.join(venv, "bin", "python"), "-I", "-m", "compileall", "-qq", "-j", "0"]
    subprocess.run(argv + [d for d in dirs if os.path.isdir(d)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    with open(mark, "w") as f:
        f.write(f"{time.time() - t0:.1f}\n")
    say("result", json.dumps({"compiled": True, "seconds": round(time.time() - t0, 1)}))


def keep_replica_key(rep):
    """The cluster's replica key and the host keys it checks peers with, in replica/CLUSTER/
    (private: 0700, the key 0600), each replaced whole (written beside, then renamed)."""
    if not NAME.fullmatch(rep["slug"]):
        raise ValueError(f"cluster {rep['slug']!r} is not a plain name")
    d = private_dir(os.path.join(G, "replica", rep["slug"]))
    for name, text in (("key", rep["key"]), ("known_hosts", rep["known"])):
        tmp = os.path.join(d, f".{name}.{os.getpid()}")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(d, name))


def build_tools(tools, python):
    """The tools environment (~/.gpufleet/tools/KEY) unless `python`'s bin has its program
    already; None, or why it could not be built."""
    if python and os.access(os.path.join(os.path.dirname(python), tools["program"]), os.X_OK):
        return None
    try:
        build_env(tools, "tools", f"installing {tools['key']} (for hang stacks)")
    except BuildError as e:
        return str(e)
    return None


def pick_torch_index(driver, table):
    """The first index of [[minimum driver, url], ...] (newest first) the driver satisfies."""
    have = tuple(int(x) for x in driver.split(".") if x.isdigit())
    for minimum, url in table:
        if have >= tuple(int(x) for x in minimum.split(".")):
            return url
    return None


def read_exact(stream, n):
    chunks, left = [], n
    while left:
        b = stream.read(min(left, 1 << 20))
        if not b:
            raise EOFError("the stream ended early")
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def store(stream, sha, size, forwards=()):
    """Write one object from `stream` into the store, its content checked against its name;
    each chunk also goes to `forwards` as it arrives (they pass it on before the object is whole:
    each receiver checks the hash itself). The partial file goes whatever ends the write."""
    tmp = os.path.join(OBJECTS, f".tmp-{os.getpid()}-{sha}")
    h, left = hashlib.sha256(), size
    try:
        with open(tmp, "wb") as f:
            while left:
                b = stream.read(min(left, 1 << 20))
                if not b:
                    raise EOFError("the stream ended early")
                h.update(b)
                f.write(b)
                for fwd in forwards:
                    fwd.data(b)
                left -= len(b)
        if h.hexdigest() != sha:
            raise ValueError(f"object {sha[:12]} arrived corrupted")
        os.chmod(tmp, 0o444)
        os.rename(tmp, os.path.join(OBJECTS, sha))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _c_source():
    """The `-c` text this python was started with: sys.orig_argv (Python 3.10+), else
    /proc/self/cmdline (Linux); None where it cannot be found."""
    argv = [os.fsencode(a) for a in getattr(sys, "orig_argv", [])]
    if b"-c" not in argv[:-1]:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return None
    if b"-c" not in argv[:-1]:
        return None
    return argv[argv.index(b"-c") + 1]


def agent_source():
    """This agent's own source: the stored copy the relay key's bootstrap checked and ran
    (sys.argv[0]), else the `-c` text it was started with (node 0, from the launching machine)."""
    if os.path.dirname(os.path.abspath(sys.argv[0])) == OBJECTS:
        with open(sys.argv[0], "rb") as f:
            return f.read()
    return _c_source() or b""


def keep_own_source():
    """Store this program's own source (the `-c` argument) as an object, so the relay key's
    forced command can run it by its hash; the hash, or None where it cannot be found. A stored
    copy that no longer matches its hash (cut short, changed) is written again."""
    source = _c_source()
    if source is None:
        return None
    sha = hashlib.sha256(source).hexdigest()
    path = os.path.join(OBJECTS, sha)
    try:
        with open(path, "rb") as f:
            intact = hashlib.sha256(f.read()).hexdigest() == sha
    except OSError:
        intact = False
    if not intact:
        tmp = os.path.join(OBJECTS, f".tmp-{os.getpid()}-{sha}")
        with open(tmp, "wb") as f:
            f.write(source)
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    os.utime(path)  # used now: `launch prune` keeps what launches use
    return sha


SHA = re.compile(r"[0-9a-f]{64}")
SNAP = re.compile(r"[0-9a-f]{16}")  # a snapshot's hash (launcher.code.snapshot)
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:%-]*")  # a host or user: never an ssh option
SIZE = re.compile(r"[0-9]{1,15}")  # a frame's size: digits only, never negative
MAX_HEADER = 256  # bytes in a frame's header line (`OBJ SHA256 SIZE` is 85)
MAX_META = {"KEY": 1 << 16, "KNOWN": 1 << 24, "FWD": 1 << 28}  # the largest KEY, KNOWN and FWD body


def is_address(text):
    """Whether `text` is an IPv4 or IPv6 address (`::1` and `fd00::3` alike)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def destination(child):
    """How a hop names the node it goes to: `USER@ADDRESS`, or `ADDRESS` where no user is given."""
    user = child.get("user")
    return f"{user}@{child['host']}" if user else str(child["host"])


def check_plan(plan, peers, port):
    """Refuse a FWD plan with a destination the forced command does not name (its `relay PORT
    PEERS` arguments: the cluster's nodes), another port, a node twice, or a malformed entry, so
    a holder of the relay key can make a node reach the cluster's own nodes and nothing else."""
    seen = set()

    def walk(children):
        if not isinstance(children, list):
            raise ValueError("the FWD plan is not a list of nodes")
        for child in children:
            if not isinstance(child, dict) or not isinstance(child.get("rank"), int):
                raise ValueError("the FWD plan holds an entry that is not a node")
            if not isinstance(child.get("host"), str) or not isinstance(child.get("user") or "", str):
                raise ValueError(f"node {child['rank']}'s destination is not a host name or address")
            dest = destination(child)
            if dest not in peers:
                raise ValueError(
                    f"node {child['rank']}'s destination {dest!r} is not one of the cluster's nodes "
                    "(the relay key reaches only those); refused"
                )
            if int(child.get("port") or 22) != port:
                raise ValueError(f"node {child['rank']}'s port {child.get('port')} is not the cluster's ({port})")
            if dest in seen:
                raise ValueError(f"{dest!r} appears twice in the FWD plan")
            seen.add(dest)
            if not isinstance(child.get("objects", []), list):
                raise ValueError(f"node {child['rank']}'s objects are not a list")
            walk(child.get("children", []))

    walk(plan)


def relay_argv(child, key, known, command="relay"):
    """ssh to a child node with the relay key (its authorized_keys entry forces `relay`), host
    keys checked strictly against the known_hosts the launcher sent. Built here from a plain
    host, port and user, never from an argv the stream carries: a holder of the relay key can
    make a node pass content on, never run a command."""
    host, user, port = child["host"], child.get("user"), int(child.get("port") or 22)
    for value in (host, user or "u"):
        if not NAME.fullmatch(value) and not (value is host and is_address(value)):
            raise ValueError(f"{value!r} is not a host or user name")
    argv = ["ssh", "-i", key, "-p", str(port)] + (["-l", user] if user else [])
    for opt in (
        "IdentitiesOnly=yes",
        "IdentityAgent=none",
        "BatchMode=yes",
        "StrictHostKeyChecking=yes",
        f"UserKnownHostsFile={known}",
        "GlobalKnownHostsFile=/dev/null",
        "UpdateHostKeys=no",
        "ControlMaster=no",
        "ControlPath=none",
        "ConnectTimeout=15",
        "ServerAliveInterval=5",
        "ServerAliveCountMax=3",
        "LogLevel=ERROR",
        # No sntrup761x25519: the first key exchange of OpenSSH 9.0 to 9.9 costs the client some
        # 85 ms of CPU a connection (curve25519-sha256: 14 ms; OpenSSH 9.2, bench/RESULTS.md), and a parent
        # opens K per launch. A hop stays inside the cluster's VPC, whose VM-to-VM traffic Google
        # Cloud encrypts and authenticates itself
        # (https://cloud.google.com/docs/security/encryption-in-transit); where the node's
        # OpenSSH has mlkem768x25519-sha256 (9.9 and later), post-quantum and as fast, it stays first.
        "KexAlgorithms=-sntrup*",
    ):
        argv += ["-o", opt]
    return argv + ["-T", "--", host, command]


def subtree(child):
    return [child["rank"]] + [r for c in child.get("children", []) for r in subtree(c)]


class Forward:
    """This node passing content on to one child node (ssh there, which runs `relay`), while its
    own stream still arrives: an object it holds goes at once, one still arriving goes chunk by
    chunk as it comes. The child gets the relay key only when it has children of its own."""

    def __init__(self, child, key, known):
        self.child = child
        self.wanted = {sha for sha in child["objects"] if SHA.fullmatch(sha)}
        self.queue = queue.Queue(maxsize=64)  # at most 64 chunks of 1 MB held for a slow child
        self.error, self.report = None, None
        self.held = sorted(sha for sha in self.wanted if has_object(sha))  # sent first, from the store
        self.wanted.difference_update(self.held)
        self.thread = threading.Thread(target=self._run, args=(key, known), daemon=True)
        self.thread.start()

    def begin(self, sha, size):
        """Whether the child wants the object now arriving (then its chunks follow, `data`)."""
        if sha not in self.wanted:
            return False
        self.wanted.discard(sha)
        self.queue.put(("head", sha, size))
        return True

    def data(self, chunk):
        self.queue.put(("data", chunk))

    def close(self):
        """Ranks of the subtree that did not get their content, and why."""
        self.queue.put(None)
        self.thread.join()
        if self.error is None:
            return {int(r): why for r, why in (self.report or {}).get("failed", {}).items()}
        rank = self.child["rank"]
        failed = {rank: self.error}
        why = f"not reached: node {rank}, which passes content on to it, failed"
        failed.update({r: why for r in subtree(self.child)[1:]})
        return failed

    def _run(self, key, known):
        children = self.child.get("children", [])
        try:
            if key is None or known is None:
                raise ValueError("no relay key arrived")
            argv = relay_argv(self.child, key, known)
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except (OSError, ValueError) as e:
            self.error = str(e)
            return self._drain()
        try:
            if children:
                for kind, path in (("KEY", key), ("KNOWN", known)):
                    with open(path, "rb") as f:
                        data = f.read()
                    p.stdin.write(f"{kind} {len(data)}\n".encode() + data)
                plan = json.dumps(children).encode()
                p.stdin.write(f"FWD {len(plan)}\n".encode() + plan)
            for sha in self.held:
                path = os.path.join(OBJECTS, sha)
                p.stdin.write(f"OBJ {sha} {os.path.getsize(path)}\n".encode())
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, p.stdin, 1 << 20)
            for item in iter(self.queue.get, None):
                if item[0] == "head":
                    p.stdin.write(f"OBJ {item[1]} {item[2]}\n".encode())
                else:
                    p.stdin.write(item[1])
            p.stdin.write(b"END\n")
            out, err = p.communicate()
        except (BrokenPipeError, ValueError, OSError):
            self._drain()
            out, err = p.communicate()
        for line in out.decode(errors="replace").splitlines():
            if line.startswith(f"{PREFIX} received "):
                self.report = json.loads(line.split(" received ", 1)[1])
        if p.returncode != 0 or self.report is None:
            self.error = (err.decode(errors="replace").strip().splitlines() or [f"exit {p.returncode}"])[-1]

    def _drain(self):
        for _ in iter(self.queue.get, None):
            pass


def header(stream):
    """One frame's header as its words; [] at the end of the stream. A line longer than
    MAX_HEADER, or one that does not end in a newline, is refused."""
    line = stream.readline(MAX_HEADER + 1)
    if not line:
        return []
    if len(line) > MAX_HEADER or not line.endswith(b"\n"):
        raise ValueError(f"a frame header over {MAX_HEADER} bytes, or cut short")
    return line.decode("ascii", errors="replace").split()


def size_of(word, kind):
    """A frame's size: decimal digits (so never negative), at most MAX_META for KEY/KNOWN/FWD."""
    if not SIZE.fullmatch(word) or int(word) > MAX_META.get(kind, 1 << 50):
        raise ValueError(f"frame {kind}: size {word[:20]!r} is not allowed")
    return int(word)


def relay(port=22, peers=()):
    """Frames in the order the sender writes them: KEY and KNOWN (the relay key and the
    cluster's known_hosts, to a node that passes content on), FWD (its children, each with the
    objects it lacks and its own children), OBJ ..., END. This is also the relay key's forced
    command, so a frame only ever writes an object (checked against its hash) or the two files
    at fixed places, removed when the relay ends; its arguments (PORT and the cluster's nodes,
    `USER@ADDRESS,...`) are the only destinations a FWD may name, once per session."""
    own_state()
    lease(OBJECTS)  # what it passes on from the store stays there while it does
    stream = sys.stdin.buffer
    work = os.path.join(G, "relay", str(os.getpid()))
    for pid in os.listdir(os.path.dirname(work)) if os.path.isdir(os.path.dirname(work)) else []:
        if not os.path.exists(f"/proc/{pid}"):  # a relay killed before it could remove its key
            shutil.rmtree(os.path.join(os.path.dirname(work), pid), ignore_errors=True)
    paths = {"KEY": os.path.join(work, "id_ed25519"), "KNOWN": os.path.join(work, "known_hosts")}
    held = {}
    forwards, count, failures = None, 0, {}
    try:
        while True:
            head = header(stream)
            if not head:
                raise EOFError("the stream ended before its END frame")
            if head == ["END"]:
                break
            if len(head) == 3 and head[0] == "OBJ" and SHA.fullmatch(head[1]):
                size = size_of(head[2], "OBJ")
                to = [fwd for fwd in forwards or [] if fwd.begin(head[1], size)]
                store(stream, head[1], size, to)
                count += 1
            elif len(head) == 2 and head[0] in paths and head[0] not in held and forwards is None:
                data = read_exact(stream, size_of(head[1], head[0]))
                os.makedirs(work, mode=0o700, exist_ok=True)
                fd = os.open(paths[head[0]], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                held[head[0]] = paths[head[0]]
            elif len(head) == 2 and head[0] == "FWD" and forwards is None:
                plan = json.loads(read_exact(stream, size_of(head[1], "FWD")))
                check_plan(plan, set(peers), port)
                forwards = [Forward(child, held.get("KEY"), held.get("KNOWN")) for child in plan]
            else:
                known = head[0] in MAX_META
                raise ValueError(f"frame {head[0]} out of place" if known else f"unknown frame {head[0]!r}")
        for fwd in forwards or []:
            failures.update(fwd.close())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say("received", json.dumps({"objects": count, "failed": failures, "at": time.time()}))


# ---- a launch down the tree (launcher.code.launch_tree) ----

# Each node's launch key, CLUSTER--ADDRESS (0600): by address too, since nodes may share one home
# (NFS), where each node's key is then beside the others' (and nothing parts them anyway).
TREE = os.path.join(G, "tree")
SEEN = os.path.join(TREE, "seen")  # each plan's nonce, once it has been run (a replay is refused)
KEY_HEX = re.compile(r"[0-9a-f]{64}")
NONCE = re.compile(r"[0-9a-f]{32}")
SEEN_KEEP_S = 86400  # a nonce is remembered this long; a plan expires long before
LOGS = os.path.join(G, "logs")  # JOB/node-RANK.log: a launch's output kept on its node (Keep)
LOG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}/node-[0-9]{1,6}[.]log")
MAX_META.update(PLAN=1 << 26, CTL=1 << 12, CODE=1 << 22)


class Refused(Exception):
    """A node's part of a launch that this node does not run: the line says why."""


def key_name(slug, address):
    """The file name of a node's launch key, or None when either part is not a plain name."""
    ok = isinstance(slug, str) and NAME.fullmatch(slug) and isinstance(address, str)
    return f"{slug}--{address}" if ok and (NAME.fullmatch(address) or is_address(address)) else None


def keys(req):
    """`keys`: this node's launch key for a cluster (`{"slug": NAME, "address": ADDRESS, "key":
    HEX}` on stdin), the key the launching machine authenticates this node's part of each launch
    with; the agent's own source is stored too (the relay key's forced command runs it by its
    hash)."""
    own_state()
    keep_own_source()
    name, key = key_name(req.get("slug"), req.get("address")), req.get("key")
    if name is None or not isinstance(key, str) or not KEY_HEX.fullmatch(key):
        raise PrivateError("the launch key request is not a cluster, an address and a key")
    d = private_dir(TREE)
    tmp = os.path.join(d, f".{name}.{os.getpid()}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(key)
    os.replace(tmp, os.path.join(d, name))
    say("result", json.dumps({"ok": True}))


def launch_key(slug, address):
    """This node's launch key for cluster `slug` at `address`, read only from this account's
    private ~/.gpufleet/tree (private_dir), from a plain file of its own no other account reads."""
    name = key_name(slug, address)
    if name is None:
        raise Refused("its plan names no cluster and address")
    try:
        d = private_dir(TREE, fix_mode=False)
        fd = os.open(os.path.join(d, name), os.O_RDONLY | os.O_NOFOLLOW)
    except PrivateError as e:
        raise Refused(str(e)) from None
    except OSError:
        raise Refused(
            f"it holds no launch key of cluster {slug} at {address} (a node replaced since the keys were set?); remove "
            f"~/.cache/gpufleet/{slug}/tree_keys.json on the launching machine and launch again"
        ) from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or not stat.S_ISREG(st.st_mode):
            raise Refused(f"{f.name} is not a private file of this account's; remove it and launch again")
        key = f.read().strip()
    if not KEY_HEX.fullmatch(key):
        raise Refused(f"{os.path.join(d, name)} holds no key; remove it and launch again")
    return bytes.fromhex(key)


def signature(key, *parts):
    """HMAC-SHA256 of `parts` (joined by NUL) under `key`, in hex (launcher.code.launch_tree.sign)."""
    return hmac.new(key, "\0".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def canonical(signed):
    return json.dumps(signed, sort_keys=True, separators=(",", ":"))


def verify(entry):
    """This node's part of a launch, checked: signed under this node's own launch key for its
    rank, not expired, its nonce never seen before (recorded now). (signed, key), else Refused."""
    signed, tag = entry.get("signed"), entry.get("mac")
    if not isinstance(signed, dict) or not isinstance(tag, str):
        raise Refused("its plan carries no signature")
    key = launch_key(signed.get("slug"), signed.get("address"))
    if not hmac.compare_digest(signature(key, canonical(signed)), tag) or signed.get("rank") != entry.get("rank"):
        raise Refused(
            "its plan's signature does not match this node's launch key: it was changed on its way, "
            "or is another node's"
        )
    if not isinstance(signed.get("expires"), (int, float)) or time.time() > signed["expires"]:
        raise Refused("its plan has expired (is this node's clock behind the launching machine's?)")
    nonce = signed.get("nonce")
    if not isinstance(nonce, str) or not NONCE.fullmatch(nonce):
        raise Refused("its plan carries no nonce")
    seen = private_dir(SEEN, fix_mode=False)
    for name in os.listdir(seen):
        path = os.path.join(seen, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_mtime < time.time() - SEEN_KEEP_S:
                os.unlink(path)
    try:
        os.close(os.open(os.path.join(seen, nonce), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        raise Refused("its plan was run once already: a replay, refused") from None
    return signed, key


def program_of(signed, code):
    """The shell line a verified part runs. A part of a launch down the tree names the node
    program's code by its hash (`code`) and carries the line around it (`program`: the text
    before the code and after it): the code itself travels once per hop (the CODE frame, held
    here as `code`), not once per node, and runs only if it matches the hash the part's
    signature covers."""
    program = signed.get("program")
    if isinstance(program, str) and "code" not in signed:
        return program
    if not (isinstance(program, list) and len(program) == 2 and all(isinstance(p, str) for p in program)):
        raise Refused("its plan carries no program")
    if code is None or hashlib.sha256(code).hexdigest() != signed.get("code"):
        raise Refused("the node program's code did not arrive whole (no CODE frame, or not the one its plan names)")
    return program[0] + shlex.quote(code.decode()) + program[1]


class Up:
    """Frames to the parent (this process's stdout): `OUT RANK SIZE` and `ERR RANK SIZE` with
    SIZE bytes, `EXIT RANK RC`, `LOST RANK VIA`. Whole frames, one writer at a time; a parent gone is ignored (the
    end of stdin stops everything)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.out = sys.stdout.buffer

    def send(self, frame):
        with self.lock:
            try:
                self.out.write(frame)
                self.out.flush()
            except (OSError, ValueError):
                pass

    def data(self, kind, rank, data):
        self.send(f"{kind} {rank} {len(data)}\n".encode() + data)

    def exit(self, rank, rc):
        self.send(f"EXIT {rank} {rc}\n".encode())


class Keep:
    """A node whose lines a launch does not show live (`--output rank0|failures` down a tree)
    keeps its output here: from `go` on, every line goes to its log on this node
    (~/.gpufleet/logs/JOB/node-RANK.log, read later by `launch logs` through the tree), and up
    goes only what the launch reads: a line matching one of the plan's `up` patterns (the exit
    marker, a stop's report, an error line, a worker's failure) at once; a line matching
    `sample` (the hang watch's progress; any line when null) at most every `every` seconds; and,
    when the part fails, its last `tail` lines not sent yet, before the exit marker or status."""

    def __init__(self, up, rank, spec):
        if not isinstance(spec, dict) or not isinstance(spec.get("log"), str) or not LOG_NAME.fullmatch(spec["log"]):
            raise Refused("its plan's log is not JOB/node-RANK.log")
        self.up, self.rank, self.name = up, rank, spec["log"]
        self.pattern = re.compile("|".join(f"(?:{p})" for p in spec.get("up") or []) or "(?!)")
        self.sample = re.compile(spec["sample"]) if spec.get("sample") else None
        self.every, self.marker = float(spec.get("every", 5)), spec.get("marker", "__GPUFLEET_EXIT__")
        self.held = collections.deque(maxlen=int(spec.get("tail", 40)))
        self.lock, self.on, self.f, self.sampled, self.told = threading.Lock(), False, None, None, False
        try:
            d = os.path.join(private_dir(LOGS), self.name.split("/")[0])
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o700)
        except (PrivateError, OSError) as e:
            raise Refused(f"it cannot keep its output in {LOGS}: {e}") from None

    def start(self):
        """`go`: the log opened (appended to: a relaunch's attempt adds to it), lines kept from
        now on; where it cannot be opened (a full disk), every line goes up instead, said once."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        try:
            self.f = os.fdopen(os.open(os.path.join(LOGS, self.name), flags, 0o600), "ab")
        except OSError as e:
            note = f"gpufleet-keep: node {self.rank} cannot keep its output on the node ({e}); every line comes up\n"
            self.up.data("ERR", self.rank, note.encode())
            return
        self.on = True

    def lines(self, kind, lines):
        """Whole lines (with their newline) of the part's `kind` stream, kept and sorted."""
        with self.lock:
            if self.f is not None:
                try:
                    self.f.writelines(lines)
                    self.f.flush()
                except OSError as e:  # a full disk: nothing is lost, every line comes up from here
                    self.f = None
                    self.fail()
                    note = f"node {self.rank} stopped keeping its output on the node ({e}); every line comes up"
                    self.up.data("ERR", self.rank, f"gpufleet-keep: {note}\n".encode())
            for raw in lines:
                text = raw.decode("utf-8", "replace")
                if self.marker in text and not text.rstrip().endswith(f"{self.marker} 0"):
                    self.fail()
                if self.f is None or self.pattern.search(text) or self._sampled(text):
                    self.up.data(kind, self.rank, raw)
                else:
                    self.held.append((kind, raw))

    def _sampled(self, text):
        now = time.monotonic()
        due = self.sampled is None or now - self.sampled >= self.every
        if not due or (self.sample is not None and not self.sample.search(text)):
            return False
        self.sampled = now
        return True

    def fail(self):
        """The part failed: its held lines go up, once."""
        if not self.told:
            self.told = True
            for kind, raw in self.held:
                self.up.data(kind, self.rank, raw)
            self.held.clear()

    def close(self, rc):
        with self.lock:
            if rc != 0:
                self.fail()
            if self.f is not None:
                with contextlib.suppress(OSError):
                    self.f.close()


class Own:
    """This node's own part: its program under bash in a session of its own, as sshd runs a
    session's command, fed its stdin (the --env values) from the signed plan; its output and its
    exit status go up as frames. `control` applies a signed word: a line on the program's stdin,
    or `eof`, the end of its input (as a closed ssh session is)."""

    def __init__(self, up, rank, signed, key, program):
        self.up, self.rank, self.key, self.nonce, self.seq = up, rank, key, signed["nonce"], 0
        self.keep = Keep(up, rank, signed["keep"]) if signed.get("keep") is not None else None
        self.p = subprocess.Popen(
            ["bash", "--norc", "--noprofile", "-c", program],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            cwd=os.path.expanduser("~"),
            # As the session's own command sees it: not the relay key's request (`tree`).
            env={k: v for k, v in os.environ.items() if k != "SSH_ORIGINAL_COMMAND"},
        )
        pumps = [
            threading.Thread(target=self._pump, args=(s, k), daemon=True)
            for s, k in ((self.p.stdout, "OUT"), (self.p.stderr, "ERR"))
        ]
        for t in pumps:
            t.start()
        self.thread = threading.Thread(target=self._end, args=(pumps,), daemon=True)
        self.thread.start()
        self.write(base64.b64decode(signed.get("stdin") or ""))

    def _pump(self, stream, kind):
        partial = b""
        for chunk in iter(lambda: os.read(stream.fileno(), 1 << 16), b""):
            if self.keep is None or not self.keep.on:
                self.up.data(kind, self.rank, chunk)
                continue
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            if len(partial) > 1 << 16:  # a line never ended (a progress bar's \r): kept in pieces
                lines.append(partial)
                partial = b""
            self.keep.lines(kind, [line + b"\n" for line in lines])
        if partial:
            self.keep.lines(kind, [partial + b"\n"])

    def _end(self, pumps):
        rc = self.p.wait()
        for t in pumps:
            t.join()
        if self.keep is not None and self.keep.on:
            self.keep.close(rc)
        self.up.exit(self.rank, rc if rc >= 0 else 255)  # a signal: ssh's own 255

    def write(self, data):
        try:
            if data:
                self.p.stdin.write(data)
                self.p.stdin.flush()
        except (OSError, ValueError):
            pass

    def close(self):
        with contextlib.suppress(OSError, ValueError):
            self.p.stdin.close()

    def control(self, body):
        """A CTL frame's body for this node: {"seq", "word", "mac"}, signed under this node's key
        with the plan's nonce; a sequence number not above the last one applied is a replay."""
        seq, word, tag = body.get("seq"), body.get("word"), body.get("mac")
        if not isinstance(seq, int) or not isinstance(word, str) or not isinstance(tag, str) or seq <= self.seq:
            return
        if not hmac.compare_digest(signature(self.key, self.nonce, self.rank, seq, word), tag):
            return
        self.seq = seq
        if word == "eof":
            self.close()
        elif re.fullmatch(r"[a-z]+( [0-9.]+)*", word):
            if word == "go" and self.keep is not None and not self.keep.on:
                self.keep.start()  # before the program reads it: its first line is kept
            self.write(word.encode() + b"\n")


def hello(stream, most=1 << 16):
    """The first of HELLO or AGENT? on an agent's stdout, or b"" at its end: what the account's
    login shell printed before it (a banner from ~/.bashrc, which bash reads under sshd) is
    passed over, up to `most` bytes."""
    seen = 0
    while seen < most:
        line = stream.readline(MAX_HEADER + 1)
        if not line or line in (b"HELLO\n", b"AGENT?\n"):
            return line
        seen += len(line)
    return b""


class Hop:
    """This node passing a launch on to one child (ssh there with the relay key, whose forced
    command runs `tree`): the child's entry of the plan, then its CTL frames; its subtree's frames
    come back up. A frame for a rank outside its subtree is dropped. The child says HELLO first,
    or AGENT? where its stored copy of this agent is missing or corrupt (launcher.code.tree's
    bootstrap): it then gets this node's own source, which it checks against the hash. Frames
    sent before that wait. When the child's session ends, each rank of its subtree that has not
    exited is reported lost, named through this node."""

    def __init__(self, up, me, child, key, known, code=None):
        self.up, self.me, self.child = up, me, child
        self.ranks = set(subtree(child))
        self.exited = set()
        self.lock = threading.Lock()
        self.p, self.why = None, None
        self.pending, self.ready, self.closing = [], False, False
        first = b""
        try:
            if key is None or known is None:
                raise ValueError("no relay key arrived")
            self.p = subprocess.Popen(
                relay_argv(child, key, known, "tree"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            if child.get("children"):
                for kind, path in (("KEY", key), ("KNOWN", known)):
                    with open(path, "rb") as f:
                        data = f.read()
                    first += f"{kind} {len(data)}\n".encode() + data
            if code is not None:
                first += f"CODE {len(code)}\n".encode() + code
            plan = json.dumps(child).encode()
            first += f"PLAN {len(plan)}\n".encode() + plan
        except (OSError, ValueError) as e:
            self.why = str(e)
        self.thread = threading.Thread(target=self._read, args=(first,), daemon=True)
        self.thread.start()

    def _write(self, frame):
        try:
            self.p.stdin.write(frame)
            self.p.stdin.flush()
        except (OSError, ValueError, AttributeError):
            pass

    def send(self, frame):
        with self.lock:
            if self.ready:
                self._write(frame)
            else:
                self.pending.append(frame)

    def close(self):
        with self.lock:
            self.closing = True
            if self.ready:
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    self.p.stdin.close()

    def _greet(self, first):
        """The child's first line of ours: HELLO, or AGENT? (this agent's source goes, then HELLO).
        Then its plan and whatever was sent meanwhile."""
        line = hello(self.p.stdout)
        if line == b"AGENT?\n":
            source = agent_source()
            self._write(f"AGENT {len(source)}\n".encode() + source)
            line = hello(self.p.stdout)
        if line != b"HELLO\n":
            raise EOFError("no answer from its agent")
        with self.lock:
            self._write(first)
            for frame in self.pending:
                self._write(frame)
            self.pending, self.ready = [], True
            if self.closing:
                with contextlib.suppress(OSError, ValueError):
                    self.p.stdin.close()

    def _read(self, first):
        err = b""
        if self.p is not None:
            errs = []
            t = threading.Thread(target=lambda: errs.append(self.p.stderr.read()), daemon=True)
            t.start()
            try:
                self._greet(first)
                self._frames(self.p.stdout)
            except (ValueError, EOFError, OSError) as e:
                self.why = None if isinstance(e, EOFError) and str(e) == "no answer from its agent" else str(e)
            with contextlib.suppress(OSError, ValueError):
                self.p.stdin.close()
            self.p.wait()
            t.join(5)
            err = errs[0] if errs else b""
        tail = err.decode(errors="replace").strip().splitlines()
        why = self.why or (tail[-1] if tail else f"its session ended without an exit status (exit {self.p.returncode})")
        rank = self.child["rank"]
        for r in sorted(self.ranks - self.exited):
            lost = (
                f"node {self.me} lost node {rank}: {why}"
                if r == rank
                else f"node {self.me} lost node {rank}, which passes the launch on to node {r}: {why}"
            )
            self.up.send(f"LOST {r} {rank}\n".encode())  # r is cut off with `rank`, or is it
            self.up.data("ERR", r, f"{lost}\n".encode())
            self.up.exit(r, 255)

    def _frames(self, stream):
        while True:
            head = header(stream)
            if not head:
                return
            if (
                len(head) != 3
                or head[0] not in ("OUT", "ERR", "EXIT", "LOST")
                or not head[1].isdigit()
                or int(head[1]) not in self.ranks
            ):
                raise ValueError(f"unexpected frame {' '.join(head)[:60]!r}")
            rank = int(head[1])
            if head[0] == "LOST":
                if head[2].isdigit() and int(head[2]) in self.ranks:
                    self.up.send(f"LOST {rank} {head[2]}\n".encode())
                continue
            if head[0] == "EXIT":
                if re.fullmatch(r"-?[0-9]{1,3}", head[2]):
                    self.exited.add(rank)
                    self.up.exit(rank, int(head[2]))
                continue
            self.up.data(head[0], rank, read_exact(stream, size_of(head[2], "OUT")))


def start_plan(up, entry, held, port, peers):
    """A PLAN frame's entry started: this node's own part (when its signature holds, else one
    line and exit 2 for it) and a hop to each child. (own or None, hops, rank -> own or hop)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("rank"), int):
        raise ValueError("the PLAN frame is not a node's entry")
    if peers is not None:
        check_plan(entry.get("children", []), set(peers), port)
    rank, own, hops = entry["rank"], None, []
    try:
        signed, key = verify(entry)
        own = Own(up, rank, signed, key, program_of(signed, held.get("CODE")))
    except Refused as e:
        up.data("ERR", rank, f"gpufleet: node {rank} refused its part of the launch: {e}\n".encode())
        up.exit(rank, 2)
    route = {rank: own}
    for child in entry.get("children", []):
        hop = Hop(up, rank, child, held.get("KEY"), held.get("KNOWN"), held.get("CODE"))
        hops.append(hop)
        route.update(dict.fromkeys(hop.ranks, hop))
    return own, hops, route


def tree(port=22, peers=None):
    """`tree`: this node's part of a launch that came down the tree, and its children's. Frames
    on stdin: KEY and KNOWN (the relay key and the cluster's known_hosts, to a node with
    children), CODE (the node program's code, which the parts name by its hash: program_of),
    PLAN (this node's entry: rank, its signed part and its children's entries, nested), then
    CTL RANK SIZE (a signed word for a node of its subtree); the end of input ends
    every program of the subtree's input (a stop, or nothing started). Frames out: launcher.code
    .launch_tree reads them. `peers`: the relay key's forced command (its `relay PORT PEERS`
    arguments) limits the children to the cluster's nodes; None for node 0, started by the
    launching machine itself."""
    own_state()
    up = Up()
    up.send(b"HELLO\n")  # the parent sends its frames once this comes (Hop)
    stream = sys.stdin.buffer
    work = os.path.join(G, "relay", str(os.getpid()))
    paths = {"KEY": os.path.join(work, "id_ed25519"), "KNOWN": os.path.join(work, "known_hosts")}
    held, own, hops, route = {}, None, [], {}
    try:
        while True:
            head = header(stream)
            if not head:
                break
            if len(head) == 2 and head[0] in paths and head[0] not in held and not route:
                data = read_exact(stream, size_of(head[1], head[0]))
                os.makedirs(work, mode=0o700, exist_ok=True)
                with open(os.open(paths[head[0]], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                    f.write(data)
                held[head[0]] = paths[head[0]]
            elif len(head) == 2 and head[0] == "CODE" and "CODE" not in held and not route:
                held["CODE"] = read_exact(stream, size_of(head[1], "CODE"))  # the node program's, in memory
            elif len(head) == 2 and head[0] == "PLAN" and not route:
                entry = json.loads(read_exact(stream, size_of(head[1], "PLAN")))
                own, hops, route = start_plan(up, entry, held, port, peers)
            elif len(head) == 3 and head[0] == "CTL" and head[1].isdigit() and route:
                body = read_exact(stream, size_of(head[2], "CTL"))
                to = route.get(int(head[1]))
                if isinstance(to, Hop):
                    to.send(f"CTL {head[1]} {len(body)}\n".encode() + body)
                elif to is not None:
                    to.control(json.loads(body))
            else:
                raise ValueError(f"frame {head[0][:20]!r} out of place")
    finally:
        if own is not None:
            own.close()
        for hop in hops:
            hop.close()
        if own is not None:
            own.thread.join()
        for hop in hops:
            hop.thread.join()
        shutil.rmtree(work, ignore_errors=True)


def hung_up(signum, frame):
    """SIGHUP (ssh's session gone: Ctrl-C on the launching machine) and SIGTERM end the program
    through its `finally`s, so no partial object or relay key stays behind."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    try:
        if sys.argv[1] == "prepare":
            prepare(json.loads(sys.stdin.read()))
        elif sys.argv[1] == "warm":
            warm(json.loads(sys.stdin.read()))
        elif sys.argv[1] == "keys":
            keys(json.loads(sys.stdin.read()))
        elif sys.argv[1] == "tree":  # node 0, from the launching machine
            signal.signal(signal.SIGHUP, hung_up)
            signal.signal(signal.SIGTERM, hung_up)
            tree()
        elif sys.argv[1] == "relay":
            signal.signal(signal.SIGHUP, hung_up)
            signal.signal(signal.SIGTERM, hung_up)
            port, peers = (int(sys.argv[2]), sys.argv[3].split(",")) if len(sys.argv) > 3 else (22, [])
            # The relay key's forced command: a parent node asks for `tree` (a launch passed on,
            # each node's part signed for it alone), else content is relayed.
            if os.environ.get("SSH_ORIGINAL_COMMAND") == "tree":
                tree(port, peers)
            else:
                relay(port, peers)
    except PrivateError as e:  # one line, the launcher's reason for this node
        sys.exit(str(e))
