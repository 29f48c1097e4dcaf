"""A newcomer's snapshot, fetched agent to agent as soon as its round closes.

Without this, a node that joins gets the agreed step over gloo from its new workers' restore
(``peer.py``), which begins only once every rank of the new round has started, made its process
group and agreed on the step: the transfer waits for all of that. The survivors' stop snapshots
are complete (and sealed: their writers exited) before the round even opens. So:

- **Every node serves its store** (:class:`Server`), a thread of the agent's persister process
  (``persist --serve``) started before that process lowers its priority, listening on the node's
  own address (``PETCTL_SNAPSHOT_SERVE_ADDR``; never a wildcard) on a port the kernel picks,
  written to ``serve.json`` in the store; a request must carry the agent's token
  (``PETCTL_SNAPSHOT_SERVE_TOKEN``, published with the address in the round's store). Two requests: ``header`` (the newest complete
  snapshot's header) and ``range`` (bytes of the snapshot named by its ``gen`` and ``nonce``,
  sent with ``sendfile`` while the slot is pinned against the writer, as the persister pins it; the
  snapshot named by its step and :func:`.stripes.digest`, so stripes of one step come from any holder).
- **A node whose store is empty fetches** (:func:`fetch`, ``python -m
  petctl_agent.checkpointing.fetch``, started by its agent the moment the round closes, beside
  its workers' start): it asks its peers for their newest header, takes the newest snapshot (by
  epoch, then step: :mod:`.timeline`) that the most of them hold byte for byte (:func:`.stripes.choose`), and receives it straight into a slot of
  its own store (:meth:`SnapshotStore.receive`: pages allocated piece by piece, every tensor's
  CRC checked as its bytes arrive) in ``PETCTL_SNAPSHOT_STREAMS`` stripes, from the holders in
  turn, one TCP connection (flow) each: cut and checked as the workers' gloo path does
  (:mod:`.stripes`). The process then exits, which seals its copy: the
  workers' restore from this node makes no pass over it.
- **The workers wait for it**: the agent holds ``fetch.lock`` for the fetch (handed to its
  process); ``memory.resume`` takes it, shared, before it looks at the store (bounded by the peer
  timeout). The restore is then from self, agreed as always; anything else (no peer answered, a
  peer died mid-transfer, a torn stripe, no room) leaves no header, and the restore's own path
  (a peer over gloo, then EFS) serves as before. A fetch never makes a restore wrong, only early.

While a range is being sent, the persister's EFS write of the same process waits
(:meth:`Server.wait_quiet`, at most ``persist.YIELD_MAX`` s a persist): the fetch is on the job's
path, the persist is not.

Bounds: the whole fetch has a deadline (the agent's: 3/4 of the workers' wait, and it kills the
process 5 s past it); a server serves 64 connections at once and one range for at most 100 s.

Wire format: each message is an 8-byte big-endian length, then that many bytes (a request's
JSON, a header's JSON: ``null`` when none). A range's answer is an 8-byte signed length (``-1``:
that snapshot is gone), then the bytes.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import processes, stripes, timeline
from petctl_agent.checkpointing.snapshot import SnapshotStore
from petctl_agent.checkpointing.stripes import Torn, choose
from petctl_agent.checkpointing.writing import OK

#: in the store: the server's address (``{"addr", "port"}``), the agent's lock held for a fetch, the
#: last fetch's account (node/snapshots.py names the first two too: a test holds them equal)
SERVE_FILE = "serve.json"
FETCH_LOCK = "fetch.lock"
FETCHED = "fetched.json"
#: bytes received per piece (each piece's CRCs computed as the next arrives)
PIECE = 16 << 20
#: seconds: a connect, and any one send or receive, before a peer counts as gone
CONNECT_TIMEOUT = 2.0
IO_TIMEOUT = 20.0
#: a server's bounds: connections served at once (a joining node opens one per stripe), seconds
#: one range may take (1 GiB at 10 MiB/s), bytes per sendfile between two looks at that deadline
MAX_CONNECTIONS = 64
RANGE_DEADLINE = 100.0
SEND_PIECE = 16 << 20
#: addresses a server never listens on (every interface of the node)
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _send(sock: socket.socket, body: Any) -> None:
    data = json.dumps(body).encode()
    sock.sendall(struct.pack(">Q", len(data)) + data)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _into(sock, memoryview(buf))
    return bytes(buf)


def _into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise Torn(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += k


def _recv(sock: socket.socket, limit: int = 64 << 20) -> Any:
    (n,) = struct.unpack(">Q", _exactly(sock, 8))
    if n > limit:
        raise Torn(f"a message of {n} bytes")
    return json.loads(_exactly(sock, n))


class Server:
    """Serve this node's store to peers that fetch (see the module docstring)."""

    def __init__(self, store: SnapshotStore, host: str, token: str = "") -> None:
        if host in WILDCARDS:
            raise ValueError(f"the snapshot server listens on the node's own address, never {host!r}")
        self.store = store
        self.token = token
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._quiet = threading.Condition()
        self._sending = 0  # ranges being sent now
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, 0), family=family)
        self.addr, self.port = host, self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="petctl-snapshot-serve", daemon=True)

    def start(self) -> Server:
        path = self.store.dir / SERVE_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"addr": self.addr, "port": self.port, "pid": os.getpid()}))
        os.replace(tmp, path)
        self._thread.start()
        return self

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def wait_quiet(self, limit: float) -> float:
        """Wait while a range is being sent, at most ``limit`` s; the seconds waited. The persister
        calls it between its EFS writes: a fetch is on the job's path (every rank waits for it),
        the persist is not, and both want the node's CPU, memory bandwidth and network interface."""
        t0 = time.monotonic()
        with self._quiet:
            self._quiet.wait_for(lambda: self._sending == 0, timeout=max(0.0, limit))
        return time.monotonic() - t0

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # as many peers as a job's newcomers need, not one thread per caller
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="petctl-snapshot-send", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT)
        with conn:
            try:
                while True:
                    try:
                        req = _recv(conn, 1 << 16)
                    except Torn:
                        return  # the peer is done
                    if not isinstance(req, dict) or not hmac.compare_digest(
                        str(req.get("token", "")), self.token
                    ):
                        return  # not one of the job's agents (the token is in the round's store)
                    if req.get("op") == "header":
                        c = self.store.newest()
                        _send(conn, c.header if c is not None else None)
                    elif req.get("op") == "range":
                        self._range(conn, req)
                    else:
                        return
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return  # a peer that went, or spoke nonsense: its fetch fails over, never ours
            finally:
                self._slots.release()

    def _range(self, conn: socket.socket, req: dict[str, Any]) -> None:
        # by its step and content (its digest): the holders of one step hold it under their own
        # generations and nonces, and a stripe may come from any of them
        step, dig = int(req["step"]), int(req["digest"])
        c = next(
            (c for c in self.store.complete() if c.step == step and stripes.digest(c.header) == dig), None
        )
        size = int(c.header["size"]) if c is not None else 0
        pin = self.store.pin(c) if c is not None else None
        if pin is None:  # gone: the writer took its slot
            conn.sendall(struct.pack(">q", -1))
            return
        try:
            lo, n = int(req["lo"]), int(req["n"])
            with open(self.store.data_path(c.slot), "rb") as f:
                if os.fstat(f.fileno()).st_size != size or not 0 <= lo <= lo + n <= size:
                    conn.sendall(struct.pack(">q", -1))
                    return
                with self._quiet:  # sending from before the length goes out: a peer that has it is counted
                    self._sending += 1
                try:
                    conn.sendall(struct.pack(">q", n))
                    # in pieces, under one deadline: a reader that trickles never holds the pin long
                    end = time.monotonic() + RANGE_DEADLINE
                    for off in range(lo, lo + n, SEND_PIECE):
                        if time.monotonic() > end:
                            return  # the connection closes: the reader's stripe is torn
                        conn.sendfile(f, off, min(SEND_PIECE, lo + n - off))
                finally:
                    with self._quiet:
                        self._sending -= 1
                        self._quiet.notify_all()
        finally:
            os.close(pin)  # unpinned: the writer may take the slot again


#: a peer's server: host, port, and the token its requests must carry
Source = tuple[str, int, str]


def _connect(src: Source, deadline: float | None = None) -> socket.socket:
    left = IO_TIMEOUT if deadline is None else deadline - time.monotonic()
    if left <= 0:
        raise Torn("out of time")
    s = socket.create_connection(src[:2], timeout=min(CONNECT_TIMEOUT, left))
    s.settimeout(min(IO_TIMEOUT, left))
    return s


def _header_of(src: Source, deadline: float | None = None) -> dict[str, Any] | None:
    try:
        with _connect(src, deadline) as s:
            _send(s, {"op": "header", "token": src[2]})
            h = _recv(s)
    except (OSError, ValueError, Torn):
        return None
    return h if stripes.sound(h) else None


def _stripe(
    src: Source, h: dict[str, Any], view: memoryview, lo: int, n: int, reserve: Any, deadline: float
) -> None:
    sums = stripes.Crcs(stripes.in_stripe(h["tensors"], lo, n))
    with _connect(src, deadline) as s:
        _send(s, {"op": "range", "token": src[2], "step": int(h["step"]), "digest": stripes.digest(h),
                  "lo": lo, "n": n})  # fmt: skip
        (got,) = struct.unpack(">q", _exactly(s, 8))
        if got != n:
            raise Torn(f"{src[0]}:{src[1]} no longer holds step {h['step']}")
        for off, k in stripes.pieces(lo, n, PIECE):
            if time.monotonic() > deadline:
                raise Torn(f"out of time at byte {off} of {lo}+{n}")
            reserve(off, k)
            # the previous piece's CRCs while this one arrives (the kernel copies, the GIL is free)
            t = threading.Thread(target=sums.catch_up, args=(view,))
            t.start()
            try:
                _into(s, view[off : off + k])
            finally:
                t.join()  # never left running over a view the caller then releases
            sums.landed(off, k)
        sums.catch_up(view)
    if not sums.ok():
        raise Torn(f"bytes {lo}+{n} from {src[0]}:{src[1]} failed their CRCs")


def fetch(
    sdir: Path, name: str, sources: list[Source], streams: int | None = None, deadline_s: float = 45.0
) -> dict[str, Any]:
    """Fetch the peers' newest snapshot into this node's store (see the module docstring), within
    ``deadline_s`` seconds (past it, whatever is under way is torn: nothing kept).

    Returns what happened (also written to ``fetched.json``): ``status`` ``ok`` (with ``step``,
    ``bytes``, ``seconds``, ``holders``), ``have`` (this store holds that step or a newer one),
    ``none`` (no peer answered with a snapshot), ``no store`` (the directory is gone: the node
    left), ``no-fit: ...`` or ``torn: ...`` (nothing kept).
    """
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    if not Path(sdir).is_dir():
        return {"status": "no store"}  # freed by its agent meanwhile: never made again here
    store = SnapshotStore(sdir, name)
    heads: list[Any] = [None] * len(sources)

    def ask(i: int) -> None:
        heads[i] = (sources[i], _header_of(sources[i], deadline))

    stripes.together([lambda i=i: ask(i) for i in range(len(sources))])
    picked = choose(heads)
    out: dict[str, Any] = {"status": "none"}
    if picked is not None:
        h, holders = picked
        size = int(h["size"])
        mine = store.newest()
        out = {"status": "have", "step": int(h["step"])}
        if mine is None or mine.key < timeline.key(h):
            k = streams or stripes.streams()
            ranges = [(lo, n) for lo, n in stripes.cut(h["tensors"], size, k) if n]

            def fill(mm: Any, reserve: Any) -> None:
                view = memoryview(mm) if mm is not None else memoryview(bytearray(0))
                try:
                    stripes.together(
                        [
                            lambda i=i, r=r: _stripe(
                                holders[i % len(holders)], h, view, *r, reserve, deadline
                            )
                            for i, r in enumerate(ranges)
                        ]  # fmt: skip
                    )
                except (OSError, ValueError) as e:
                    raise Torn(f"{type(e).__name__}: {e}") from e
                finally:
                    view.release()

            try:
                why = store.receive(h, fill)
            except Torn as e:
                why = f"torn: {e}"
            out = {"status": "ok" if why == OK else why, "step": int(h["step"]), "bytes": size,
                   "holders": len(holders), "streams": len(ranges)}  # fmt: skip
            if why == OK:
                c = store.newest()
                out.update(gen=c.gen if c else None, nonce=c.header.get("nonce") if c else None)
    store.close()
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["t"] = time.time()
    path = Path(sdir) / FETCHED
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(out))
        os.replace(tmp, path)
    except OSError:
        pass  # the store is being removed (the node leaves)
    return out


def fetched(sdir: Path, header: dict[str, Any] | None) -> bool:
    """Did this node's last fetch write the snapshot of ``header`` (a restore's source, named)?"""
    if header is None:
        return False
    try:
        f = json.loads((Path(sdir) / FETCHED).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(f, dict) and f.get("gen") == header.get("gen") and f.get("nonce") == header.get("nonce")


def wait_for_fetch(sdir: Path, timeout: float) -> float:
    """Wait (at most ``timeout`` s) until no fetch into this node's store is under way: the lock
    the agent holds for it (shared here, so every rank of the node waits at once). Seconds waited."""
    import fcntl

    from petctl_agent import filelocks

    path = Path(sdir) / FETCH_LOCK
    t0 = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0.0  # never fetched on this node
    try:
        filelocks.flock_within(fd, fcntl.LOCK_SH, timeout, 0.005)
    finally:
        os.close(fd)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    """``python -m petctl_agent.checkpointing.fetch SNAPSHOT_DIR NAME [--deadline S] < SOURCES``: the
    agent's fetch for a node that joins. SOURCES, on stdin (the tokens are never on a command line):
    a JSON list of ``{"addr", "port", "token"}``. Exits 0 whatever the outcome (the restore's own
    path is the fallback; ``fetched.json`` and one stderr line say what happened)."""
    processes.die_with_parent()
    ap = argparse.ArgumentParser(prog="petctl_agent.checkpointing.fetch")
    ap.add_argument("snapshot_dir")
    ap.add_argument("name")
    ap.add_argument("--deadline", type=float, default=45.0, help="seconds the whole fetch may take")
    a = ap.parse_args(argv)
    try:
        srcs = [
            (str(s["addr"]), int(s["port"]), str(s.get("token", ""))) for s in json.loads(sys.stdin.read())
        ]
        out = fetch(Path(a.snapshot_dir), a.name, srcs, deadline_s=a.deadline)
    except Exception as e:  # noqa: BLE001 - never fatal: the workers' restore has its own path
        out = {"status": f"error: {type(e).__name__}: {e}"}
    print(f"petctl fetch: {json.dumps(out)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
