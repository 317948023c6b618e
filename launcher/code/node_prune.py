"""The node side of `launch prune`: one self-contained, standard-library-only program, sent as
its source text (`python3 -I -S -c SOURCE scan`) as launcher.code.node_agent is. It finds what
launches left under ~/.gpufleet that nothing needs any more, and removes it when asked.

Stdin carries a JSON request: `older_than_s` (how long unused before it may go), `remove`
(false: only report), `keep` (absolute paths some job still needs, from the job host's records).
Ends with `PREFIX result JSON`: every candidate with its size and what was decided, the paths
this host's own job records pin, and the disk's free space.

What may go, and what never does:
- `work/JOB/` (a job's directory: a copy of its --sync snapshot and whatever the job wrote
  there), `envs/KEY/` (a built environment), `snap/HASH/` (gpufleet's code, hard links into the
  store), `logs/JOB/` (an attached launch's output its nodes kept, `--fanout`: used when a line
  was last written), and a detached job's leftover `node-runs/JOB/ATTEMPT.RANK/` whose supervisor ended
  (`rc` written) but whose output no controller came back to read;
- then `objects/SHA256` no snapshot links any more (the store is only a cache of what was sent:
  a later launch sends it again), and partial objects `objects/.tmp-PID-SHA` whose writer is gone.
A candidate stays when it was used within `older_than_s` (a launch's preparation sets the
mtime of what it uses: node_agent.prepare), when a running process of this account has its
working directory, an argument or an environment value in it (ranks run in work/JOB with
VIRTUAL_ENV=envs/KEY and PYTHONPATH=snap/HASH), or when a job that has not ended pins it (`keep`,
and the records under ~/.gpufleet/jobs on this host: PENDING, RUNNING and RECOVERING jobs, whose
relaunch checks its prepared paths are still there). Never touched: jobs/ (the records),
clusters/ (keys), code/ (the controller's copy of launcher/), uv/, leases/.

Removal renames first (a reader never sees half a directory), and an environment is removed
under its build lock (node_agent.build_env's `KEY.lock`), so a launch building or checking it
at that moment waits, then builds it again. Each item is removed under its exclusive lease
(~/.gpufleet/leases/PATH, flock) with its age checked again there; a launch's preparation
holds a shared lease on everything it uses (node_agent.prepare) and marks it used, so a prune never removes
what a launch has just found in place.
"""

import fcntl
import json
import os
import shutil
import sys
import time

PREFIX = "gpufleet-prepare:"
G = os.path.join(os.path.expanduser("~"), ".gpufleet")
LIVE = ("PENDING", "RUNNING", "RECOVERING")


def last_used(path):
    """When a launch last used the directory (node_agent.prepare sets its mtime to the time of
    every launch that uses it; a job writing files there moves it too). A launch's kept logs
    (logs/JOB/) were used when a line was last written to one of them."""
    try:
        times = [os.stat(path).st_mtime]
        if os.path.dirname(path) == os.path.join(G, "logs"):
            times += [st.st_mtime for st in file_stats(path)]
        return max(times)
    except OSError:
        return 0.0


def file_stats(path):
    """os.lstat of every file under `path` (one that vanished meanwhile is left out)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                yield os.lstat(os.path.join(root, name))
            except OSError:
                continue


def size_of(path, shared_ok=True):
    """Bytes the files under `path` hold; `shared_ok=False` counts only files with one link (a
    snapshot's hard links free nothing until their objects go)."""
    return sum(st.st_size for st in file_stats(path) if shared_ok or st.st_nlink == 1)


def candidates():
    """(kind, path) of every directory a launch left that prune may consider."""
    out = []
    for kind, sub in (("work", "work"), ("env", "envs"), ("code", "snap")):
        d = os.path.join(G, sub)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            p = os.path.join(d, name)
            if os.path.isdir(p) and not os.path.islink(p):
                # A `.tmp-` directory is one a preparation or a prune was writing or deleting
                # when it died: old enough, it goes too.
                out.append(("leftover" if ".tmp-" in name else kind, p))
    logs = os.path.join(G, "logs")  # a launch's output its nodes kept (node_agent.Keep)
    if os.path.isdir(logs):
        for job in sorted(os.listdir(logs)):
            p = os.path.join(logs, job)
            if os.path.isdir(p) and not os.path.islink(p):
                out.append(("kept log", p))
    runs = os.path.join(G, "node-runs")
    if os.path.isdir(runs):
        for job in sorted(os.listdir(runs)):
            if not os.path.isdir(os.path.join(runs, job)) or os.path.islink(os.path.join(runs, job)):
                continue  # a stray file: nothing a launch left
            for attempt in sorted(os.listdir(os.path.join(runs, job))):
                p = os.path.join(runs, job, attempt)
                if os.path.isdir(p) and os.path.exists(os.path.join(p, "rc")):
                    out.append(("run output", p))
    return out


def references():
    """Every path a running process of this account names: its working directory, its
    arguments, its environment values (each PATH-like value split at ':')."""
    refs = set()
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        base = f"/proc/{pid}"
        try:
            refs.add(os.readlink(base + "/cwd"))
        except OSError:
            pass
        for name in ("cmdline", "environ"):
            try:
                with open(f"{base}/{name}", "rb") as f:
                    items = f.read().split(b"\0")
            except OSError:
                continue
            for item in items:
                text = item.decode(errors="replace")
                value = text.split("=", 1)[1] if name == "environ" and "=" in text else text
                refs.update(v for v in value.split(":") if v.startswith("/"))
    return refs


def pinned_here():
    """The prepared paths of every job on this host whose record says it has not ended."""
    jobs = os.path.join(G, "jobs")
    out = []
    if not os.path.isdir(jobs):
        return out
    for job in sorted(os.listdir(jobs)):
        try:
            with open(os.path.join(jobs, job, "state.json")) as f:
                state = json.load(f).get("state")
            if state not in LIVE:
                continue
            with open(os.path.join(jobs, job, "request.json")) as f:
                prepared = json.load(f).get("config", {}).get("prepared", [])
        except (OSError, ValueError):
            continue
        out += [{"job": job, "path": p} for p in prepared]
    return out


def inside(path, others):
    """Whether any of `others` is `path` or lies under it."""
    prefix = path.rstrip("/") + "/"
    return any(o == path or o.startswith(prefix) for o in others)


def lease_file(path):
    """Where the lease on `path` (under ~/.gpufleet) is kept: the same relative path under
    ~/.gpufleet/leases, so the directories a person looks into hold only what a launch left."""
    return os.path.join(G, "leases", os.path.relpath(path, G))


def lease(path, how):
    """The lease on `path` (~/.gpufleet/leases/PATH, flock(2)): a launch holds it shared while
    it uses the path (node_agent.lease, the same protocol), a prune exclusive while it removes it. An open
    file descriptor, or None when `how` has LOCK_NB and another holds it. A lease file a prune
    removed while this waited is opened again, so both always lock the same file."""
    name = lease_file(path)
    os.makedirs(os.path.dirname(name), exist_ok=True)
    while True:
        fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(name).st_ino
        except OSError:
            same = False
        if same:
            return fd
        os.close(fd)


def pid_alive(name):
    """Whether the process that names a `.tmp-PID-...` file still runs."""
    pid = name.split("-")[1] if name.count("-") >= 2 else ""
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


def remove(kind, path):
    """Rename aside, then delete; an environment under its build lock."""
    trash = f"{path}.tmp-prune-{os.getpid()}"
    if kind == "env":
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            os.rename(path, trash)
    else:
        os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
    if kind == "run output":  # the job's node-runs directory, once its last attempt is gone
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass


def prunable_objects(going, older_than_s, now):
    """Objects no snapshot would link once `going` (snapshot directories) are gone, and partial
    objects (`.tmp-PID-SHA`) whose writer no longer runs."""
    objects = os.path.join(G, "objects")
    if not os.path.isdir(objects):
        return []
    links = {}  # inode -> links held by the snapshots that go
    for path in going:
        for st in file_stats(path):
            links[st.st_ino] = links.get(st.st_ino, 0) + 1
    out = []
    for name in sorted(os.listdir(objects)):
        p = os.path.join(objects, name)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if name.startswith(".tmp-"):
            if not pid_alive(name):  # a transfer cut short (Ctrl-C, a lost connection, a kill)
                out.append((p, st.st_size))
            continue
        if now - st.st_mtime < older_than_s:
            continue
        if st.st_nlink - links.get(st.st_ino, 0) <= 1:
            out.append((p, st.st_size))
    return out


def remove_objects(objects, older_than_s):
    """Unlink `objects` under the store's exclusive lease, each checked again there (a launch
    holds the lease shared and marks the objects it uses as used now); how many went, or None
    when a launch holds the store."""
    fd = lease(os.path.join(G, "objects"), fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:
        return None
    gone = 0
    try:
        now = time.time()
        for p, _ in objects:
            try:
                st = os.lstat(p)
            except OSError:
                continue
            name = os.path.basename(p)
            if name.startswith(".tmp-") and pid_alive(name):
                continue
            if not name.startswith(".tmp-") and (now - st.st_mtime < older_than_s or st.st_nlink > 1):
                continue
            try:
                os.unlink(p)
                gone += 1
            except OSError:
                pass
    finally:
        os.close(fd)
    return gone


def remove_unused(item, older_than_s):
    """Remove one candidate under its exclusive lease, its age checked again there: a launch
    that used it since the scan (node_agent.prepare marks what it uses under a shared lease)
    keeps it. Sets `removed`, or `kept` with why."""
    path = item["path"]
    fd = lease(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:
        item["kept"] = "a launch is using it now"
        return
    try:
        if time.time() - last_used(path) < older_than_s:
            item["kept"] = "used recently"
            return
        remove(item["kind"], path)
        item["removed"] = True
    except OSError as e:
        item["kept"] = f"could not remove it: {e.strerror or e}"
        return
    finally:
        if item.get("removed"):
            try:
                os.unlink(lease_file(path))  # under the lock: a waiter opens the file again (lease)
            except OSError:
                pass
        os.close(fd)


def scan(req):
    now = time.time()
    older = float(req["older_than_s"])
    pinned = pinned_here()
    keep = set(req.get("keep", [])) | {p["path"] for p in pinned}
    refs = references()
    items, going = [], []
    for kind, path in candidates():
        age = now - last_used(path)
        item = {"kind": kind, "path": path, "age_s": round(age), "bytes": size_of(path, kind != "code")}
        if inside(path, keep):
            item["kept"] = "a job that has not ended needs it"
        elif inside(path, refs):
            item["kept"] = "in use by a running process"
        elif age < older:
            item["kept"] = "used recently"
        items.append(item)
        if "kept" not in item:
            going.append(item)
    for item in going:
        if req.get("remove"):
            remove_unused(item, older)
    # Listing only: count the objects as if the snapshots that would go were gone.
    gone = [] if req.get("remove") else [i["path"] for i in going if i["kind"] == "code"]
    objects = prunable_objects(gone, older, now)
    if objects:
        item = {"kind": "objects", "path": os.path.join(G, "objects"), "count": len(objects), "age_s": None}
        item["bytes"] = sum(size for _, size in objects)
        if req.get("remove"):
            gone = remove_objects(objects, older)
            if gone is None:
                item["kept"] = "a launch is using the store now"
            else:
                item["removed"] = True
                item["count"] = gone
        items.append(item)
    os.makedirs(G, exist_ok=True)
    disk = shutil.disk_usage(G)
    result = {"items": items, "pinned": pinned, "free": disk.free, "total": disk.total, "home": G}
    sys.stdout.write(f"{PREFIX} result {json.dumps(result)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "scan":
        scan(json.loads(sys.stdin.read()))
