"""Stand-ins for what a GPU node has and this machine does not: `nvidia-smi`, a kernel log with the
driver's lines, `docker` (for the receive-datapath manager), and the metadata server.

Each simulated node gets its own directory at the front of its PATH (sshd SetEnv, tests/simcluster)
holding three small bash programs written from a `FakeGpuNode`:
- `nvidia-smi` applies the query it is given as the real one does: `--query-gpu=F1,F2,...
  --format=csv,noheader,nounits` prints the asked fields in the asked order, ", "-separated, one
  line per GPU; an unknown field is refused as nvidia-smi refuses it (`Field "x" is not a valid
  field to query.`, exit 2); no arguments prints the plain table, whose header carries the driver
  and CUDA versions; `-L` lists the GPUs. With no GPU it prints what nvidia-smi prints with no
  driver loaded and exits 9. Any other call (`-pm 1`, `-r`, ...) would change the GPU: it is
  refused, and every call is logged to `calls.log` so a test can see what was asked.
- `dmesg` prints a kernel log whose NVRM lines are the node's XIDs, in the driver's format.
- `docker` answers `docker ps -q -f name=^NAME$` with a container id when that container runs.
The values of a healthy GPU are the real H100's (tests/fixtures/nvidia-smi/h100-query.csv).

`FakeMetadata` serves `/computeMetadata/v1/instance/attributes/physical_host` for one node like the
metadata server: only with the `Metadata-Flavor: Google` request header (403 otherwise), the value
as text/plain with `Metadata-Flavor: Google` on the reply, 404 when the VM has none. Nodes reach
it through GCE_METADATA_HOST, the variable google-auth honours.
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from gpufleet.health import GPU_QUERY_FIELDS
from tests.simcluster import SimCluster

__all__ = ["H100", "FakeGpu", "FakeGpuNode", "FakeMetadata", "GpuSimCluster", "healthy_gpus"]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi" / "h100-query.csv"


@dataclass(frozen=True)
class FakeGpu:
    """One GPU's values, as nvidia-smi prints them with `nounits`."""

    values: dict[str, str]

    def with_(self, **changes: str) -> "FakeGpu":
        """A copy with some fields changed, named as nvidia-smi names them."""
        return FakeGpu({**self.values, **changes})


def _fixture_gpu() -> FakeGpu:
    line = FIXTURE.read_text().strip().splitlines()[0]
    return FakeGpu(dict(zip(GPU_QUERY_FIELDS, (v.strip() for v in line.split(",")))))


H100 = _fixture_gpu()


def healthy_gpus(n: int = 8, driver: str | None = None) -> list[FakeGpu]:
    """n H100s as the real one reported itself, each with its own index, UUID and PCI address."""
    out = []
    for i in range(n):
        v = dict(H100.values)
        v["index"] = str(i)
        v["uuid"] = f"GPU-0c310bbf-9a9d-a3a9-9784-b63f233e10e{i}"
        v["pci.bus_id"] = f"00000000:{0x04 + i * 2:02X}:00.0"  # distinct per GPU
        if driver:
            v["driver_version"] = driver
        out.append(FakeGpu(v))
    return out


@dataclass
class FakeGpuNode:
    gpus: list[FakeGpu] = field(default_factory=healthy_gpus)
    cuda: str = "13.0"  # tests/fixtures/nvidia-smi/h100-nvidia-smi.txt
    xids: list[tuple[str, int]] = field(default_factory=list)  # (PCI address, XID code)
    running_containers: tuple[str, ...] = ("receive-datapath-manager",)

    def ecc(self, gpu: int, errors: int) -> "FakeGpuNode":
        self.gpus[gpu] = FakeGpu({**self.gpus[gpu].values, "ecc.errors.uncorrected.volatile.total": str(errors)})
        return self

    def write(self, bin_dir: Path) -> Path:
        """Write nvidia-smi, dmesg and docker into bin_dir; return it."""
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name, text in (("nvidia-smi", self._smi()), ("dmesg", self._dmesg()), ("docker", self._docker())):
            p = bin_dir / name
            p.write_text(text)
            p.chmod(0o755)
        return bin_dir

    def _smi(self) -> str:
        log = "printf '%s\\n' \"$*\" >> \"$(dirname \"$0\")/calls.log\""
        driver = self.gpus[0].values["driver_version"] if self.gpus else ""
        rows = []
        for i, g in enumerate(self.gpus):
            rows.append(" ".join(f"[{shlex.quote(f'{i}:{k}')}]={shlex.quote(v)}" for k, v in g.values.items()))
        table = (
            "Mon Nov 23 09:19:07 2026\n"
            "+-----------------------------------------------------------------------------------------+\n"
            f"| NVIDIA-SMI {driver:<22} Driver Version: {driver:<14} CUDA Version: {self.cuda:<9}|\n"
            "+-----------------------------------------+------------------------+----------------------+\n"
        )
        csv = "".join(", ".join(g.values[f] for f in GPU_QUERY_FIELDS) + "\n" for g in self.gpus)
        listing = "".join(f"GPU {i}: {g.values['name']} (UUID: {g.values['uuid']})\n" for i, g in enumerate(self.gpus))
        no_driver = (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running."
        )
        return f"""#!/bin/bash
# A fake nvidia-smi written by tests/launcher/fake_gpu_node.py: {len(self.gpus)} GPUs.
{log}
n={len(self.gpus)}
if [ "$n" = 0 ]; then echo {shlex.quote(no_driver)}; exit 9; fi
declare -A V=({' '.join(rows)})
known=" {' '.join(GPU_QUERY_FIELDS)} "
case "$1" in
  --query-gpu={",".join(GPU_QUERY_FIELDS)})
    # doctor's own query, answered from the same table, precomputed (one printf, as a node's
    # nvidia-smi is a compiled program, not a bash loop on a shared CPU)
    [ "$2" = --format=csv,noheader,nounits ] ||
      {{ echo "fake nvidia-smi: only --format=csv,noheader,nounits" >&2; exit 2; }}
    printf %s {shlex.quote(csv)};;
  --query-gpu=*)
    [ "$2" = --format=csv,noheader,nounits ] ||
      {{ echo "fake nvidia-smi: only --format=csv,noheader,nounits" >&2; exit 2; }}
    IFS=, read -r -a F <<< "${{1#--query-gpu=}}"
    for f in "${{F[@]}}"; do
      case "$known" in *" $f "*) ;; *) echo "Field \\"$f\\" is not a valid field to query."; exit 2;; esac
    done
    for ((i = 0; i < n; i++)); do
      line=; sep=
      for f in "${{F[@]}}"; do line+="$sep${{V[$i:$f]}}"; sep=", "; done
      printf '%s\\n' "$line"
    done;;
  -L) printf %s {shlex.quote(listing)};;
  "") printf %s {shlex.quote(table)};;
  *) echo "fake nvidia-smi: $1 would change the GPU; refused" >&2; exit 3;;
esac
"""

    def _dmesg(self) -> str:
        lines = [
            "[    0.000000] Linux version 6.8.0-1015-gcp (buildd@lcy02-amd64-050)",
            "[    5.123456] nvidia: loading out-of-tree module taints kernel.",
        ]
        for k, (pci, code) in enumerate(self.xids):
            lines.append(f"[ {1000 + k}.000000] NVRM: Xid (PCI:{pci}): {code}, pid=4242, name=python3, Ch 00000008")
        return "#!/bin/bash\nprintf '%s\\n' " + " ".join(shlex.quote(l) for l in lines) + "\n"

    def _docker(self) -> str:
        running = " ".join(shlex.quote(c) for c in self.running_containers)
        return f"""#!/bin/bash
# A fake docker: `docker ps -q -f name=^NAME$` prints an id when NAME runs.
[ "$1 $2 $3" = "ps -q -f" ] || {{ echo "fake docker: only ps -q -f name=^NAME\\$" >&2; exit 1; }}
want=${{4#name=^}}; want=${{want%\\$}}
for c in {running}; do [ "$c" = "$want" ] && echo 3f2a9c1e7b44; done
exit 0
"""


class FakeMetadata:
    """The metadata server of one node (what doctor and the preemption watcher read). `host`
    is GCE_METADATA_HOST. `instance/preempted` is FALSE until `preempt()` (for every client, or for
    the one at `address`: one server may stand for several nodes' own, each asking from its own
    address, as each VM asks its own); with
    `?wait_for_change=true` a GET waits until the value changes, or for `timeout_sec` when given
    (https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange)."""

    PATH = "/computeMetadata/v1/instance/attributes/physical_host"
    PREEMPTED = "/computeMetadata/v1/instance/preempted"
    # TRUE on a Spot or preemptible VM (https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys).
    PREEMPTIBLE = "/computeMetadata/v1/instance/scheduling/preemptible"

    def __init__(
        self, physical_host: str | None, bind: str = "0.0.0.0", reach_at: str = "127.0.0.1", spot: bool = False
    ):
        self.physical_host = physical_host
        self.spot = spot
        self.requests: list[str] = []
        self.preempted = False
        self.preempted_addresses: set[str] = set()
        self._changed = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                fake.requests.append(self.path)
                if self.headers.get("Metadata-Flavor") != "Google":
                    self._reply(403, "Missing required header \"Metadata-Flavor\": \"Google\"\n")
                elif self.path == fake.PATH and fake.physical_host is not None:
                    self._reply(200, fake.physical_host)
                elif self.path == fake.PREEMPTIBLE:
                    self._reply(200, "TRUE" if fake.spot else "FALSE")
                elif self.path.partition("?")[0] == fake.PREEMPTED:
                    query = parse_qs(urlsplit(self.path).query)
                    self._reply(200, fake.wait_preempted(query, self.client_address[0]))
                else:
                    self._reply(404, "Not Found\n")

            def _reply(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away while it waited (a node stopped, its watcher killed)

        self._server = ThreadingHTTPServer((bind, 0), Handler)
        self._reach_at = reach_at
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return f"{self._reach_at}:{self._server.server_address[1]}"

    def preempt(self, address: str | None = None) -> None:
        """Compute Engine sends the preemption notice: `instance/preempted` turns TRUE (for the
        node asking from `address` only, when given)."""
        with self._changed:
            if address is None:
                self.preempted = True
            else:
                self.preempted_addresses.add(address)
            self._changed.notify_all()

    def boot(self, address: str | None = None) -> None:
        """The VM (the one at `address`, or every one) started again: not preempted any more."""
        with self._changed:
            if address is None:
                self.preempted = False
            self.preempted_addresses.discard(address or "")
            self._changed.notify_all()

    def wait_preempted(self, query: dict[str, list[str]], address: str = "") -> str:
        def now() -> bool:
            return self.preempted or address in self.preempted_addresses

        with self._changed:
            if query.get("wait_for_change") == ["true"]:
                was = now()
                timeout = float(query["timeout_sec"][0]) if "timeout_sec" in query else None
                self._changed.wait_for(lambda: now() != was, timeout=timeout)
            return "TRUE" if now() else "FALSE"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


MTYPE = "a3-highgpu-8g"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class GpuSimCluster:
    """A SimCluster of healthy a3-highgpu-8g nodes on COS, one per entry of `places` (each node's
    physical_host; None: its metadata server has none): the fakes at the front of each node's
    PATH, its own metadata server (GCE_METADATA_HOST), four GPU NICs eth1..eth4 made of real veth
    pairs with the catalog's MTU 8244 in the node's namespace, its own ready marker, and the TCPX
    plugin in a directory `args()` points LD_LIBRARY_PATH at. `env`: more variables for a node's
    sessions, by index (a HOME of its own, for a detached job's records). Needs netns mode (root)."""

    def __init__(self, root: Path, places: list[str | None], env: dict[int, dict[str, str]] | None = None):
        self.root = root
        self.n = len(places)
        self.places = list(places)
        self.sim = SimCluster(self.n, workdir=root / "sim")
        if self.sim.mode != "netns":
            raise RuntimeError("the simulated GPU cluster needs netns mode (root and `ip netns`) for its GPU NICs")
        self.metadata = [FakeMetadata(p, reach_at=self.sim.gateway) for p in places]
        self.plugin = root / "tcpx" / "lib64"
        self.plugin.mkdir(parents=True)
        for lib in ("libnccl-net.so", "libnccl.so.2.21.5"):
            (self.plugin / lib).write_text("")
        self.sim.node_env = {
            i: {
                "PATH": f"{self.bin(i)}:{SYSTEM_PATH}",
                "GCE_METADATA_HOST": self.metadata[i].host,
                "GPUFLEET_READY_MARKER": str(self.marker(i)),
                "GPUFLEET_LOCAL_SSD_MOUNT": "/",
                **(env or {}).get(i, {}),
            }
            for i in range(self.n)
        }
        for i in range(self.n):
            self.heal(i)
        try:
            self.sim.start()
            for i in range(self.n):
                for k in range(1, 5):
                    self._ip(
                        i,
                        "link",
                        "add",
                        f"eth{k}",
                        "mtu",
                        "8244",
                        "type",
                        "veth",
                        "peer",
                        "name",
                        f"peer{k}",
                        "mtu",
                        "8244",
                    )
                    self._ip(i, "link", "set", f"eth{k}", "up")
                    self._ip(i, "link", "set", f"peer{k}", "up")
        except BaseException:
            self.close()
            raise

    def _ip(self, i: int, *args: str) -> None:
        r = self.sim.exec(i, ["ip", *args])
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} on node {i}: {r.stderr.strip()}")

    def bin(self, i: int) -> Path:
        return self.root / f"node{i}" / "bin"

    def marker(self, i: int) -> Path:
        return self.root / f"node{i}" / "ready.json"

    def heal(self, i: int, fake: FakeGpuNode | None = None) -> None:
        """Node i healthy again (or as `fake` says), with its own ready marker and placement."""
        (fake or FakeGpuNode()).write(self.bin(i))
        (self.bin(i) / "calls.log").unlink(missing_ok=True)
        self.marker(i).write_text(
            json.dumps(
                {
                    "cluster": "doc",
                    "node": f"gpu-{i}",
                    "machine_type": MTYPE,
                    "net_stack": "gpudirect-tcpx",
                    "driver": "580.159.04",
                    "cuda": "13.0",
                    "nccl": "2.21.5",
                    "plugin": "gpudirecttcpx-v3.1.9+rxdm-v2.0.12",
                    "nccl_tests": "4bd4c13",
                    "booted_at": "2026-11-23T08:00:00Z",
                }
            )
            + "\n"
        )
        self.metadata[i].physical_host = self.places[i]

    def args(self, runs: Path, python: str = sys.executable) -> list[str]:
        """`launch doctor` flags for these nodes (the hostfile, ssh, the machine type...)."""
        return [
            "--hostfile",
            str(self.sim.hostfile),
            *self.sim.launch_flags,
            "--machine-type",
            MTYPE,
            "--python",
            python,
            "--env",
            f"LD_LIBRARY_PATH={self.plugin}",
            "--min-free-gb",
            "0.01",
            "--runs-dir",
            str(runs / "runs"),
        ]

    def close(self) -> None:
        self.sim.stop()
        for m in self.metadata:
            m.close()
