"""torchft's lighthouse, as petctl runs it: bound to one address, with petctl's timeouts.

    python -m petctl_agent.live.lighthouse --bind 127.0.0.1:29510 --min-replicas 1

The lighthouse forms a quorum of replica groups every step. It runs on the rendezvous instance
beside etcd (same boot, same security group: only the job's workers reach it), because its
``/status`` page and ``/replica/<id>/kill`` endpoint have no authentication
(torchft ``src/lighthouse.rs``: the axum ``Router`` beside the gRPC service).

Timeouts, and why they differ from torchft's defaults (join 60 s, heartbeat 5 s, tick 100 ms):

- ``heartbeat_timeout_ms`` (1000): how long a replica that stopped heartbeating still counts as
  healthy. A drain and a hard loss cost the survivors about this much: the lighthouse's only way
  to forget a replica is its heartbeat ageing out (``quorum_compute``: ``healthy_replicas``).
  Heartbeats come from the manager's Rust thread every 100 ms, not from Python, so a busy or
  GIL-bound worker keeps heartbeating; only a dead, stopped or cut-off one stops.
- ``join_timeout_ms`` (60000): how long a quorum waits for a healthy replica that has not
  asked yet. Kept long: with a short one, a newcomer that asked early and the first survivor
  form a quorum without the second survivor (``first_joined`` is the newcomer's time), and the
  second survivor then heals from a peer. A replica that left or died stops heartbeating, so the
  heartbeat timeout, not this one, bounds a drain or a loss.
- ``quorum_tick_ms`` (20): how often expiry is checked; a request also ticks at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class LighthouseOptions:
    """What a lighthouse is started with (see the module's docstring for why each value)."""

    bind: str = "127.0.0.1:29510"
    min_replicas: int = 1
    join_timeout_ms: int = 60_000
    heartbeat_timeout_ms: int = 1_000
    quorum_tick_ms: int = 20

    def argv(self) -> list[str]:
        """The command line of :func:`main` for these options (the agent's launch)."""
        return [
            sys.executable,
            "-m",
            "petctl_agent.live.lighthouse",
            "--bind",
            self.bind,
            "--min-replicas",
            str(self.min_replicas),
            "--join-timeout-ms",
            str(self.join_timeout_ms),
            "--heartbeat-timeout-ms",
            str(self.heartbeat_timeout_ms),
            "--quorum-tick-ms",
            str(self.quorum_tick_ms),
        ]


def unit(bind: str) -> str:
    """The rendezvous server's systemd unit for this lighthouse (user_data/rdzv.sh.j2 writes it):
    it runs this interpreter (the server's lighthouse environment), restarts with the server and
    after a crash, and logs warnings only (torchft logs every step's quorum at INFO: the journal
    would grow by lines a second)."""
    return (
        "[Unit]\n"
        "Description=torchft lighthouse for a petctl live job\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n\n"
        "[Service]\n"
        "Type=simple\n"
        "Environment=RUST_LOG=warn\n"
        f"ExecStart={sys.executable} -m petctl_agent.live.lighthouse --bind {bind}\n"
        "Restart=always\n"
        "RestartSec=2\n\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def is_wildcard(host: str) -> bool:
    """``host`` means every interface: nothing live mode starts may listen there."""
    return host.strip("[]") in ("", "::", "0.0.0.0")


def native():
    """torchft's compiled module (``torchft._torchft``) alone, without its package.

    ``import torchft`` runs its ``__init__``, which imports torch; the lighthouse is Rust and needs
    none of it. The rendezvous instance installs the torchft wheel without its dependencies
    (user_data/rdzv.sh.j2), so a multi-GB torch never lands on a small server, and this loads the
    extension from the package's directory without executing the package.
    """
    import importlib.machinery
    import importlib.util
    import os

    name = "torchft._torchft"
    if name in sys.modules:
        return sys.modules[name]
    pkg = importlib.util.find_spec("torchft")  # a top-level package: found, not imported
    if pkg is None or not pkg.submodule_search_locations:
        raise RuntimeError("torchft is not installed: pip install --no-deps torchft==0.2.0")
    for d in pkg.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(d, "_torchft" + suffix)
            if os.path.exists(path):
                loader = importlib.machinery.ExtensionFileLoader(name, path)
                spec = importlib.util.spec_from_file_location(name, path, loader=loader)
                assert spec is not None
                mod = importlib.util.module_from_spec(spec)
                loader.exec_module(mod)
                sys.modules[name] = mod
                return mod
    raise RuntimeError(f"torchft's compiled module is not in {list(pkg.submodule_search_locations)}")


def serve(opts: LighthouseOptions):
    """Start a lighthouse in this process; returns torchft's ``LighthouseServer``."""
    return native().LighthouseServer(
        bind=opts.bind,
        min_replicas=opts.min_replicas,
        join_timeout_ms=opts.join_timeout_ms,
        quorum_tick_ms=opts.quorum_tick_ms,
        heartbeat_timeout_ms=opts.heartbeat_timeout_ms,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="petctl-lighthouse", description=__doc__.split("\n")[0])
    d = LighthouseOptions()
    p.add_argument("--bind", default=d.bind, help="host:port; never [::] or 0.0.0.0 (no auth)")
    p.add_argument("--min-replicas", type=int, default=d.min_replicas)
    p.add_argument("--join-timeout-ms", type=int, default=d.join_timeout_ms)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=d.heartbeat_timeout_ms)
    p.add_argument("--quorum-tick-ms", type=int, default=d.quorum_tick_ms)
    p.add_argument("--unit", action="store_true", help="print the systemd unit that runs this lighthouse")
    a = p.parse_args(argv)
    host = a.bind.rpartition(":")[0].strip("[]")
    if is_wildcard(host):
        p.error(f"--bind {a.bind}: give the address only the job's workers reach")
    if a.unit:
        print(unit(a.bind), end="")
        return 0
    opts = LighthouseOptions(
        a.bind, a.min_replicas, a.join_timeout_ms, a.heartbeat_timeout_ms, a.quorum_tick_ms
    )
    server = serve(opts)
    port = server.address().rpartition(":")[2]
    # One line a launcher can wait on: the real port when --bind asked for port 0.
    print(f"lighthouse listening on http://{host}:{port}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
