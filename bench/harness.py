"""Real-process test harness: etcd (plain or TLS), a fake per-instance IMDS, agent processes.

Test-only, so it lives outside the ``petctl_agent`` package (which ships to every instance):
``tests/agent`` and ``tests/faults`` put ``bench/`` on ``sys.path`` (their conftest), the
benchmarks here (``agent_timings.py``, ``benchlib.py``, ...) import it from their own directory,
and ``scripts/gpu_check.py`` puts ``bench/`` on its path. Everything listens on 127.0.0.0/8;
nothing talks to AWS (specs leave log group, groups and hook empty).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

STEP_RE = re.compile(r"\] step=(\d+) world_size=(\d+) loss=")
REPO = Path(__file__).resolve().parent.parent


def _etcd_pins() -> Any:
    """petctl/templates/etcd.py (standard library only), loaded from this checkout's file: the
    benchmarks here and the GPU check also run where petctl is not installed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_petctl_etcd_pins", REPO / "petctl" / "templates" / "etcd.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: the flags every etcd petctl starts gets (petctl/templates/etcd.py SERVER_FLAGS: progress
#: notifications every 10 s, compaction, quota); the harness's etcd runs with them too
ETCD_SERVER_FLAGS: tuple[str, ...] = tuple(_etcd_pins().SERVER_FLAGS)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server started a moment later.

    Taken below the kernel's ephemeral range (``ip_local_port_range``, 32768+ on Linux): a port
    from that range can be handed to any outgoing connection (the workers', the agents') between
    this check and the server's bind, and etcd then died with "address already in use" (CI).

    Free on the wildcard address too: a server that binds it (torch's ``TCPStore`` in a plain
    ``env://`` worker) fails on a port that a local-cloud node holds on its own 127.x.y.z, which a
    check on 127.0.0.1 alone does not see (CI: EADDRINUSE in test_forkserver_exit).
    """
    for _ in range(100):
        port = random.randint(20000, 32000)
        if _bindable(host, port) and _bindable("::" if ":" in host else "", port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``pred`` until truthy (returned) or raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ---- fake IMDS --------------------------------------------------------------------------
class FakeImds:
    """IMDSv2 look-alike serving many instances at ``http://127.0.0.1:<port>/<instance-id>``."""

    def __init__(self) -> None:
        self.instances: dict[str, dict[str, str]] = {}
        imds = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _split(self) -> tuple[dict[str, str] | None, str]:
                parts = self.path.lstrip("/").split("/", 1)
                inst = imds.instances.get(parts[0])
                return inst, (parts[1] if len(parts) > 1 else "")

            def do_PUT(self) -> None:
                inst, rest = self._split()
                if inst is None or rest != "latest/api/token":
                    self.send_error(404)
                    return
                self._reply(200, "token-" + inst["meta-data/instance-id"])

            def do_GET(self) -> None:
                inst, rest = self._split()
                if inst is None:
                    self.send_error(404)
                    return
                if self.headers.get("X-aws-ec2-metadata-token") != "token-" + inst["meta-data/instance-id"]:
                    self.send_error(401)
                    return
                key = rest.removeprefix("latest/")
                if key not in inst:
                    self.send_error(404)
                    return
                self._reply(200, inst[key])

            def _reply(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, instance_id: str, ip: str, tags: dict[str, str] | None = None) -> str:
        d = {
            "meta-data/instance-id": instance_id,
            "meta-data/local-ipv4": ip,
            "meta-data/placement/region": "us-east-1",
            "meta-data/placement/availability-zone": "us-east-1a",
            "meta-data/autoscaling/target-lifecycle-state": "InService",
        }
        for k, v in (tags or {}).items():
            d[f"meta-data/tags/instance/{k}"] = v
        self.instances[instance_id] = d
        return f"{self.url}/{instance_id}"

    def set(self, instance_id: str, key: str, value: str | None) -> None:
        if value is None:
            self.instances[instance_id].pop(f"meta-data/{key}", None)
        else:
            self.instances[instance_id][f"meta-data/{key}"] = value

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- etcd -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EtcdCerts:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (PEM paths)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def agent_env(self) -> dict[str, str]:
        """The agent's TLS settings (what the worker boot script puts in its systemd unit)."""
        return {
            "PETCTL_ETCD_CACERT": str(self.ca),
            "PETCTL_ETCD_CERT": str(self.client_cert),
            "PETCTL_ETCD_KEY": str(self.client_key),
        }


def make_etcd_certs(directory: Path) -> EtcdCerts:
    """Write a CA and the etcd server and client certificates it signed into ``directory``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
        c, k = directory / f"{stem}.pem", directory / f"{stem}.key"
        c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        k.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return c, k

    def issue(cn: str, ca_key: Any, usage: list[Any], san: list[Any] | None) -> tuple[Any, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(name("petctl-test-ca"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        )
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("petctl-test-ca"))
        .issuer_name(name("petctl-test-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, _ = write("ca", ca_key, ca)
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    # clientAuth too, as the job's rendezvous boot makes it: etcd dials its own client URLs with
    # its server certificate, and with --client-cert-auth it rejects itself without it
    eku = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    server = write("server", *issue("etcd", ca_key, eku, san))
    client = write("client", *issue("petctl-worker", ca_key, [ExtendedKeyUsageOID.CLIENT_AUTH], None))
    return EtcdCerts(ca_path, server[0], server[1], client[0], client[1])


class Etcd:
    """A real etcd 3.5 with the v2 API on 127.0.0.1; restartable on the same port and data dir.

    The one launcher of the agent tests, the fault tests and the benchmarks. With ``certs`` it
    serves https only and requires a client certificate signed by their CA (``--client-cert-auth``),
    as the job's rendezvous instance does when the job's etcd speaks TLS. It runs with the flags
    the job's etcd runs with (``ETCD_SERVER_FLAGS``); ``progress_interval`` (seconds) replaces
    the 10 s progress notify interval (tests of a quiet watch).
    """

    def __init__(
        self,
        root: Path,
        binary: str = "etcd",
        certs: EtcdCerts | None = None,
        progress_interval: float | None = None,
    ) -> None:
        self.root = Path(root)
        self.flags = list(ETCD_SERVER_FLAGS)
        if progress_interval is not None:
            i = self.flags.index("--experimental-watch-progress-notify-interval")
            self.flags[i + 1] = f"{int(progress_interval * 1000)}ms"
        self.data_dir = self.root / "etcd-data"
        self.binary = shutil.which(binary) or binary
        self.certs = certs
        self.port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> float:
        """Start (or restart) etcd; return seconds until it answered the v2 API."""
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        scheme = "https" if self.certs else "http"
        url, peer = f"{scheme}://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.certs:
            c = self.certs
            tls = [
                "--cert-file", str(c.server_cert), "--key-file", str(c.server_key),
                "--trusted-ca-file", str(c.ca), "--client-cert-auth",
            ]  # fmt: skip
        with open(self.root / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary, "--enable-v2", "--name", "petctl-test", "--data-dir", str(self.data_dir),
                    "--listen-client-urls", url, "--advertise-client-urls", url,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"petctl-test={peer}", "--log-level", "warn", *tls, *self.flags,
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_for(
            self.healthy,
            timeout,
            f"etcd on {self.endpoint} to become healthy (see {self.root}/etcd.log)",
            0.05,
        )
        return time.monotonic() - t0

    def _get(self, path: str) -> Any:
        ctx = None
        if self.certs:
            ctx = ssl.create_default_context(cafile=str(self.certs.ca))
            ctx.load_cert_chain(str(self.certs.client_cert), str(self.certs.client_key))
        scheme = "https" if self.certs else "http"
        with urllib.request.urlopen(f"{scheme}://{self.endpoint}{path}", timeout=1, context=ctx) as r:
            return json.loads(r.read())

    def healthy(self) -> bool:
        try:
            self._get("/v2/keys/")
            return True
        except OSError:
            return False

    def keys(self) -> list[str]:
        """Every leaf key in the v2 store (what rendezvous handlers wrote)."""
        out, todo = [], [self._get("/v2/keys/?recursive=true")["node"]]
        while todo:
            n = todo.pop()
            todo.extend(n.get("nodes", []))
            if not n.get("dir"):
                out.append(n["key"])
        return out

    def pause(self, timeout: float = 10) -> None:
        """SIGSTOP etcd and return once every one of its threads has stopped.

        kill() returns once the signal is queued: the kernel wakes one thread to take it, and only
        that thread stops the others. On a loaded box that thread can wait for a CPU while another
        goes on serving requests (seen in CI: a range answered after the SIGSTOP).
        """
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)
        wait_for(lambda: all_threads_stopped(self.proc.pid), timeout, f"etcd {self.proc.pid} stopped", 0.01)

    def resume(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            self.proc.wait(15)
        self.proc = None


class FreezingProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` (``host:port``) that can silently freeze
    every connection open at that moment (:meth:`freeze`): it stops forwarding in both
    directions and keeps both sockets open, so neither side gets a FIN or a RST, as when a NAT
    or a connection-tracking entry (EC2's, after 350 s idle on Nitro v6) is dropped on the
    way. Connections made after a freeze go through. Whatever a frozen peer sends stays in
    the kernel's buffers; TCP keepalive probes are answered by this host's kernel, as a
    half-dead path's middlebox does not (that is why the client must notice silence itself).

    One selector thread moves the bytes; :meth:`close` ends it and closes every socket."""

    def __init__(self, upstream: str) -> None:
        import selectors

        host, _, port = upstream.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(port))
        self._sel = selectors.DefaultSelector()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._lsock.setblocking(False)
        self.port = self._lsock.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []  # forwarding
        self.frozen: list[tuple[socket.socket, socket.socket]] = []  # open, never read again
        self.accepted = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._lsock, 1, None)
        self._sel.register(self._wake_r, 1, None)
        self._stop = False
        self._partitioned = False
        self._todo: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._loop, name="freezing-proxy", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.5):
                s = key.fileobj
                if s is self._wake_r:
                    self._wake_r.recv(4096)
                    with self._lock:
                        todo, self._todo = self._todo, []
                    for f in todo:
                        f()
                elif s is self._lsock:
                    self._accept()
                else:
                    self._pump(s, key.data)

    def _accept(self) -> None:
        try:
            c, _ = self._lsock.accept()
        except OSError:
            return
        try:
            u = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            c.close()
            return
        for s, peer in ((c, u), (u, c)):
            s.setblocking(False)
            if not self._partitioned:  # partitioned: held, forwarded from heal() on
                self._sel.register(s, 1, peer)
        with self._lock:
            self._pairs.append((c, u))
            self.accepted += 1

    def _pump(self, s: socket.socket, peer: socket.socket) -> None:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            try:
                peer.settimeout(5)  # tests move little data: a bounded blocking send is fine
                peer.sendall(data)
                peer.setblocking(False)
                return
            except OSError:
                pass
        self._drop(s, peer)

    def _drop(self, a: socket.socket, b: socket.socket) -> None:
        for s in (a, b):
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        with self._lock:
            self._pairs = [p for p in self._pairs if a not in p]

    def _call(self, f: Callable[[], None]) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                f()
            finally:
                done.set()

        with self._lock:
            self._todo.append(run)
        self._wake_w.send(b"x")
        done.wait(5)

    def freeze(self) -> int:
        """Stop forwarding on every open connection, closing none; returns how many."""

        def f() -> None:
            with self._lock:
                pairs, self._pairs = self._pairs, []
            for pair in pairs:
                for s in pair:
                    self._sel.unregister(s)
            self.frozen.extend(pairs)

        self._call(f)
        return len(self.frozen)

    def partition(self) -> None:
        """Stop forwarding on every connection, open and new (accepted, then held), closing
        none, until :meth:`heal`: a network partition between the clients and etcd that ends.
        What either side sends meanwhile waits in the kernel's buffers."""

        def f() -> None:
            self._partitioned = True
            with self._lock:
                pairs = list(self._pairs)
            for pair in pairs:
                for s in pair:
                    self._sel.unregister(s)

        self._call(f)

    def heal(self) -> None:
        """End :meth:`partition`: every connection it held forwards again (a client that gave
        up on one closed it meanwhile; that close arrives now)."""

        def f() -> None:
            self._partitioned = False
            with self._lock:
                pairs = list(self._pairs)
            for c, u in pairs:
                self._sel.register(c, 1, u)
                self._sel.register(u, 1, c)

        self._call(f)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join(5)
        with self._lock:
            pairs = self._pairs + self.frozen
            self._pairs, self.frozen = [], []
        for s in (self._lsock, self._wake_r, self._wake_w, *(x for p in pairs for x in p)):
            s.close()
        self._sel.close()

    def __enter__(self) -> FreezingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def all_threads_stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is in the stopped state (T, or t when traced)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # a thread that exited
        if state not in ("T", "t"):
            return False
    return True


# ---- agents -----------------------------------------------------------------------------
@dataclass
class Node:
    instance_id: str
    addr: str
    proc: subprocess.Popen
    agent_dir: Path
    started: float
    imds_base: str = ""
    lines: list[tuple[float, str]] = field(default_factory=list)
    steps: list[tuple[float, int, int]] = field(default_factory=list)  # (t, step, world)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def last_step(self) -> int:
        return self.steps[-1][1] if self.steps else 0


class Cluster:
    """etcd + fake IMDS + N agent processes sharing one 'EFS' directory."""

    def __init__(
        self,
        tmp: Path,
        job: str = "job-test",
        min_nodes: int = 2,
        max_nodes: int = 4,
        script_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        drain_timeout: float = 30,
        script: Path | None = None,
        nproc_per_node: int = 1,
        spec_extra: dict[str, Any] | None = None,
        etcd_tls: bool = False,
    ) -> None:
        self.tmp = Path(tmp)
        self.job = job
        self.efs = self.tmp / "efs"
        self.efs.mkdir(parents=True, exist_ok=True)
        self.status_dir = self.tmp / "status"
        certs = make_etcd_certs(self.tmp / "tls") if etcd_tls else None
        self.etcd = Etcd(self.tmp, certs=certs)
        self.imds = FakeImds()
        self.nodes: dict[str, Node] = {}
        self.extra_env = {**(certs.agent_env() if certs else {}), **(extra_env or {})}
        # this cluster's own snapshot base (a tmpfs, as on a node): clusters run side by side reuse
        # job names and instance ids ("i-0001"), and a store is <base>/<job>/<instance>
        self.shm: Path | None = None
        if "PETCTL_AGENT_SNAPSHOT_DIR" not in self.extra_env and Path("/dev/shm").is_dir():
            self.shm = Path(tempfile.mkdtemp(prefix="petctl-cluster-", dir="/dev/shm"))
            self.extra_env["PETCTL_AGENT_SNAPSHOT_DIR"] = str(self.shm)
        self._next = 1
        code = self.tmp / "code"
        code.mkdir(exist_ok=True)
        script = Path(script) if script else REPO / "scripts" / "elastic_train.py"
        shutil.copy(script, code / script.name)
        self.ckpt_rel = f"petctl/jobs/{job}/checkpoints"
        spec = {
            "version": 1,
            "job_name": job,
            "user": "test",
            "region": "us-east-1",
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "nproc_per_node": nproc_per_node,
            "code_url": f"file://{code / script.name}",
            "code_kind": "script",
            "script": script.name,
            "args": script_args or [],
            "env": {"OMP_NUM_THREADS": "1"},
            "checkpoint_dir": self.ckpt_rel,
            "status_url": f"file://{self.status_dir}/",
            "log_group": "",
            "worker_group": "",
            "rdzv_group": "",
            "lifecycle_hook": "",
            "drain_timeout": drain_timeout,
            "rdzv_port": 2379,
            **(spec_extra or {}),
        }
        self.spec_path = self.tmp / "job.json"
        self.spec_path.write_text(json.dumps(spec, indent=2))

    @property
    def ckpt_dir(self) -> Path:
        return self.efs / self.ckpt_rel

    @property
    def work_dir(self) -> Path:
        """Where the workers start (their cwd): shared by every node of the job."""
        return self.efs / "petctl" / "jobs" / self.job / "work"

    def start_etcd(self) -> None:
        self.etcd.start()

    def add_node(self, lifecycle_state: str = "InService") -> Node:
        """Start one more agent; ``lifecycle_state``: its IMDS target lifecycle state at start
        (``Warmed:Running``: an instance of the group's warm pool)."""
        n = self._next
        self._next += 1
        iid = f"i-{n:04d}"
        addr = f"127.0.0.{10 + n}"
        base = self.imds.add(
            iid, addr, {"petctl:spec": str(self.spec_path), "petctl:rdzv": self.etcd.endpoint}
        )
        self.imds.set(iid, "autoscaling/target-lifecycle-state", lifecycle_state)
        agent_dir = self.tmp / "nodes" / iid
        agent_dir.mkdir(parents=True, exist_ok=True)
        node = self._launch(iid, addr, base, agent_dir)
        self.nodes[iid] = node
        return node

    def restart_node(self, node: Node) -> Node:
        """A new agent process on ``node``'s instance (its IMDS and agent dir), as systemd's
        restart of a failed agent; ``node`` must have exited."""
        assert node.proc.poll() is not None, f"{node.instance_id} is still running"
        fresh = self._launch(node.instance_id, node.addr, node.imds_base, node.agent_dir)
        self.nodes[node.instance_id] = fresh
        return fresh

    def _launch(self, iid: str, addr: str, base: str, agent_dir: Path) -> Node:
        env = {
            **os.environ,
            "PETCTL_IMDS_URL": base,
            "PETCTL_EFS_MOUNT": str(self.efs),
            "PETCTL_AGENT_DIR": str(agent_dir),
            "PETCTL_AGENT_STATUS_INTERVAL": "1",
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # belt and braces: never real AWS
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        cmd = [sys.executable, "-m", "petctl_agent.main", "run", "--local-addr", addr]
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(agent_dir / "agent.err", "ab"),
            start_new_session=True,
            cwd=str(agent_dir),
        )
        node = Node(iid, addr, proc, agent_dir, time.time(), imds_base=base)
        threading.Thread(target=self._read, args=(node,), daemon=True).start()
        return node

    def _read(self, node: Node) -> None:
        log = open(node.agent_dir / "agent.out", "a")
        assert node.proc.stdout is not None
        for raw in node.proc.stdout:
            t = time.time()
            line = raw.decode(errors="replace").rstrip("\n")
            node.lines.append((t, line))
            log.write(f"{t:.3f} {line}\n")
            log.flush()
            m = STEP_RE.search(line)
            if m:
                node.steps.append((t, int(m.group(1)), int(m.group(2))))

    def status(self, iid: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.status_dir / f"{iid}.json").read_text())
        except (OSError, ValueError):
            return None

    def kill_hard(self, node: Node) -> None:
        """SIGKILL the agent's process group and every descendant (an instance vanishing)."""
        # here, not at the top: scripts/gpu_check.sh imports this file on a GPU box where
        # petctl's own dependencies (click, through petctl.local) may be missing
        from petctl.local.procs import descendants

        victims = descendants(node.proc.pid)
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.proc.wait(10)

    @staticmethod
    def now() -> float:
        return time.time()

    def terminate(self, node: Node) -> None:
        node.proc.send_signal(signal.SIGTERM)

    def live(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive()]

    def all_at_world(self, nodes: list[Node], world: int, after: float, min_steps: int = 1) -> bool:
        """Every node printed >= ``min_steps`` step lines at world size ``world`` after ``after``."""
        return all(sum(1 for t, _, w in n.steps if t > after and w == world) >= min_steps for n in nodes)

    def wait(self, pred: Callable[[], Any], timeout: float, what: str, alive: list[Node] = ()) -> Any:
        """``wait_for`` that fails at once (with the agent's stderr tail) if a node in ``alive`` exits."""

        def check() -> Any:
            for n in alive:
                if not n.alive():
                    err = (n.agent_dir / "agent.err").read_text(errors="replace")[-3000:]
                    raise AssertionError(
                        f"{n.instance_id} exited ({n.proc.returncode}) while waiting for {what}:\n{err}"
                    )
            return pred()

        try:
            return wait_for(check, timeout, what)
        except TimeoutError as e:  # say where each node stood: a CI timeout is otherwise mute
            raise TimeoutError(f"{e}\n{self.describe()}") from None

    def assert_succeeded(self, nodes: list[Node]) -> None:
        """Each of ``nodes``' agents exited 0 and its status says SUCCEEDED (else: what they did)."""
        for n in nodes:
            st = self.status(n.instance_id) or {}
            assert n.proc.returncode == 0 and st.get("state") == "SUCCEEDED", (
                n.proc.returncode, st, self.describe(),
            )  # fmt: skip

    def describe(self, lines: int = 12) -> str:
        """Each node's last step line (seconds since start, step, world) and its agent's last lines."""
        out = []
        for n in self.nodes.values():
            last = n.steps[-1] if n.steps else None
            try:
                err = (n.agent_dir / "agent.err").read_text(errors="replace").splitlines()[-lines:]
            except OSError as e:
                err = [f"(agent.err: {e})"]
            out.append(f"--- {n.instance_id} alive={n.alive()} steps={len(n.steps)} last={last}")
            out.extend("    " + ln[:300] for ln in err)
        return "\n".join(out)

    def max_step(self) -> int:
        return max((n.last_step() for n in self.nodes.values()), default=0)

    def close(self) -> None:
        for n in self.nodes.values():
            if n.alive():
                self.kill_hard(n)
        self.etcd.stop()
        self.imds.close()
        if self.shm is not None:
            shutil.rmtree(self.shm, ignore_errors=True)


def recovery(cluster: Cluster, t_event: float, survivors: list[Node], gap: float = 3.0) -> dict[str, Any]:
    """Time from ``t_event`` until every node in ``survivors`` is stepping again, and steps lost.

    A node "steps again" at its first step line after ``t_event`` that breaks its
    sequence (new world size, a step that is not previous+1 -- a resume from a
    checkpoint --, or a pause longer than ``gap`` seconds: workers restarted at the
    same world size from a checkpoint of the last step), or at its first line if it
    printed none before (a newcomer).
    A node whose sequence never breaks was not interrupted. Steps lost = highest
    step reached before the break minus the step training resumed from.
    """
    resume_times: list[float] = []
    resumed_from: list[int] = []
    reached: list[int] = []
    for n in survivors:
        prev: tuple[int, int] | None = None
        prev_t = t_event
        after = 0
        for t, step, world in n.steps:
            if t <= t_event:
                prev, prev_t = (step, world), t
                continue
            after += 1
            if prev is None or world != prev[1] or step != prev[0] + 1 or t - max(prev_t, t_event) > gap:
                resume_times.append(t)
                resumed_from.append(step - 1)
                if prev is not None:
                    reached.append(prev[0])
                break
            prev, prev_t = (step, world), t
        else:
            if after == 0:
                return {"recovered": False}
            if prev is not None:
                reached.append(prev[0])
    if not resume_times:  # nobody was interrupted
        return {"recovered": True, "seconds": 0.0, "steps_lost": 0, "interrupted": False}
    start = min(resumed_from)
    return {
        "recovered": True,
        "seconds": round(max(resume_times) - t_event, 2),
        "steps_lost": max(0, max(reached, default=start) - start),
        "resumed_from": start,
        "reached_before": max(reached, default=start),
        "interrupted": True,
    }


def run_together(cmd: list[str], n: int, cwd: Path, timeout: float = 90) -> list[str]:
    """Start ``n`` copies of ``cmd`` at once (nodes of one job), wait for all; their outputs.

    Fails on the first that exits non-zero (its output's tail in the message); kills the rest.
    """
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        for _ in range(n)
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
            if p.returncode != 0:
                raise AssertionError(f"exit {p.returncode}: {out[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs
