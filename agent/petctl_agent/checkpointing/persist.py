"""The agent's persister process: the workers' memory snapshots persisted to the checkpoint
directory off their training processes (the persist itself: :mod:`.persisting`).

Where it runs: a child process of the agent (``python -m petctl_agent.checkpointing.persist --serve
SNAPSHOT_DIR NAME``), started when the node's store is made and stopped when the node leaves the
job: it outlives worker restarts (a drain exits the workers with ``os._exit`` right after the
snapshot) and keeps a long EFS write off the training process's GIL. It serves requests: the
worker that persists (global rank 0) writes ``persist.request`` (``{"step", "epoch", "dir", "keep"}``)
into the store's directory right after its copy; the server persists the newest complete snapshot
once one of that step and epoch (or newer) is complete, and writes what happened to ``persist.json`` (``step``
persisted, or ``error`` with ``error_step``). It holds an exclusive ``flock`` on ``persist.lock``
while alive, which is how a worker tells that nobody serves its requests (no agent: plain torchrun,
tests), and then persists itself (:class:`.persisting.Persister`, the same loop as a thread).

The same command checks the newest snapshot for the agent (``--verify``), runs this node's snapshot
server for joining peers (``fetch.py``) beside the serve loop, and lowers its own CPU priority.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from petctl_agent import filelocks, knobs
from petctl_agent.checkpointing import persisting, processes, timeline
from petctl_agent.checkpointing.atomic import atomic_write
from petctl_agent.checkpointing.files import read_pointer
from petctl_agent.checkpointing.snapshot import SnapshotStore

#: files in the store's directory (node/snapshots.py, the agent's side, names the same ones)
REQUEST = "persist.request"
STATE = "persist.json"
LOCK = "persist.lock"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def request(snapshot_dir: Path, step: int, directory: Path, keep: int, epoch: int = 0) -> None:
    """Ask the agent's persister to persist ``step`` of ``epoch`` (once complete) into ``directory``."""
    body = {
        "step": int(step),
        "epoch": int(epoch),
        "dir": str(directory),
        "keep": int(keep),
        "t": time.time(),
    }
    atomic_write(Path(snapshot_dir) / REQUEST, json.dumps(body).encode())


def served(snapshot_dir: Path) -> bool:
    """Is a persister process serving ``snapshot_dir`` (it holds ``persist.lock``)?"""
    return filelocks.held(Path(snapshot_dir) / LOCK)


def state(snapshot_dir: Path) -> dict[str, Any]:
    """What the persister last reported (``persist.json``), or ``{}``."""
    return _read_json(Path(snapshot_dir) / STATE) or {}


#: seconds one persist waits at most, in all, for this node's snapshot server to finish sending
#: (:meth:`.fetch.Server.wait_quiet`): a newcomer's fetch goes first; a stream of them never
#: holds the durable copy back for long
YIELD_MAX = 30.0


def serve(
    snapshot_dir: Path,
    name: str,
    poll: float = 0.05,
    stop: threading.Event | None = None,
    server: Any = None,
) -> int:
    """The agent's persister: serve ``persist.request`` until SIGTERM (the persist in flight, or a
    request whose snapshot is complete but not yet persisted, ends first). ``server`` (this node's
    :class:`.fetch.Server`, or None): each persist's writes wait while it sends a range to a peer
    that fetches, :data:`YIELD_MAX` s at most in all."""
    sdir = Path(snapshot_dir)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    lock = filelocks.hold(sdir / LOCK)  # one persister per store; held until we exit
    store = SnapshotStore(sdir, name)
    done: tuple[str, tuple[int, int]] | None = None  # the last request served: (dir, (epoch, step))
    try:
        while True:
            # stopping (the node leaves): the request already made is still served, once, if its
            # snapshot is complete -- a drain that a survivor covered did not wait for it
            stopping = stop.is_set()
            req = _read_json(sdir / REQUEST)
            want = timeline.key(req)
            if req and "step" in req and "dir" in req and done != (req["dir"], want):
                c = store.newest()
                # that snapshot complete (or a newer one: by epoch, then step)
                if c is not None and c.key >= want:
                    d = Path(req["dir"])
                    try:
                        persisting.persist_newest(store, d, int(req.get("keep", 3)), _yielding(server))
                        p = read_pointer(d) or {}
                        if timeline.key(p) >= want:
                            done = (req["dir"], want)
                            _report(sdir, {"step": int(p["step"]), "dir": str(d)})
                            print(f"petctl persist: step {p['step']} -> {d}", file=sys.stderr, flush=True)
                    except Exception as e:  # noqa: BLE001 - reported; the waiting worker writes itself
                        done = (req["dir"], want)
                        why = f"{type(e).__name__}: {e}"
                        _report(sdir, {"error": why, "error_step": int(req["step"]), "dir": str(d)})
                        print(f"petctl persist: step {req['step']}: {why}", file=sys.stderr, flush=True)
                    if stopping:
                        break
                    continue
            if stopping:
                break
            stop.wait(poll)
    finally:
        store.close()
        os.close(lock)
    return 0


def _yielding(server: Any) -> Any:
    """A persist's ``pause``: wait while ``server`` sends, :data:`YIELD_MAX` s at most in all."""
    if server is None:
        return None
    left = [YIELD_MAX]

    def pause() -> None:
        if left[0] > 0:
            left[0] -= server.wait_quiet(left[0])

    return pause


def _report(sdir: Path, body: dict[str, Any]) -> None:
    try:
        atomic_write(sdir / STATE, json.dumps({**body, "t": time.time(), "pid": os.getpid()}).encode())
    except OSError:
        pass  # the store is being removed (the node leaves)


#: the persister's CPU niceness by default (``PETCTL_PERSIST_NICE``, 0-19; 0: as the agent)
PERSIST_NICE = 10


def _yield_cpu() -> int:
    """Raise this process's niceness by ``PETCTL_PERSIST_NICE`` (default 10) and return that step.

    The persister's work is background work: a checkpoint's copy to EFS (``torch.save`` from the
    mapping, its CRC pass, the page cache), often a whole GiB at once. It starts exactly when a
    drain's new workers start and runs while training steps, on the same cores. At nice 10 the
    scheduler gives it about a tenth of a core that the workers want (CFS weights 110 vs 1024) and
    every idle cycle, so it is never starved, only put behind. Threads it starts inherit it. The
    agent's ``--verify`` pass is not lowered: a restore from self may wait for it."""
    raw = os.environ.get("PETCTL_PERSIST_NICE") or str(PERSIST_NICE)
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= 19:
        print(
            f"petctl persist: PETCTL_PERSIST_NICE={raw!r} is not a whole number from 0 to 19; using {PERSIST_NICE}",
            file=sys.stderr,
            flush=True,
        )
        n = PERSIST_NICE
    if n:
        try:
            os.nice(n)
        except OSError:
            pass  # a priority we may not lower further is fine: it is only a courtesy
    return n


def _start_server(sdir: Path, name: str) -> Any:
    """This node's snapshot server for peers that fetch (``fetch.py``) on
    ``PETCTL_SNAPSHOT_SERVE_ADDR`` (the agent's node address); None when unset or it cannot listen."""
    addr = os.environ.get("PETCTL_SNAPSHOT_SERVE_ADDR")
    if not addr:
        return None
    from petctl_agent.checkpointing.fetch import Server

    try:
        return Server(
            SnapshotStore(sdir, name), addr, os.environ.get("PETCTL_SNAPSHOT_SERVE_TOKEN", "")
        ).start()
    except (OSError, ValueError) as e:
        print(
            f"petctl persist: no snapshot server on {addr} ({e}); peers restore over gloo",
            file=sys.stderr,
            flush=True,
        )
        return None


def main(argv: list[str] | None = None) -> int:
    """``python -m petctl_agent.checkpointing.persist --serve SNAPSHOT_DIR NAME``: the agent's persister.

    ``--verify SNAPSHOT_DIR NAME``: check the newest snapshot once and record it
    (:meth:`SnapshotStore.verify`), then exit.

    ``SNAPSHOT_DIR NAME CHECKPOINT_DIR`` (without ``--serve``): poll and persist the newest snapshot.
    """
    ap = argparse.ArgumentParser(prog="petctl_agent.checkpointing.persist")
    ap.add_argument("snapshot_dir")
    ap.add_argument("name")
    ap.add_argument("checkpoint_dir", nargs="?")
    ap.add_argument("--serve", action="store_true", help="serve the workers' persist.request (the agent's)")
    ap.add_argument("--keep", type=int, default=knobs.checkpoint_keep())
    ap.add_argument("--poll", type=float, default=0.5)
    ap.add_argument("--once", action="store_true", help="persist the newest snapshot (if newer) and exit")
    ap.add_argument(
        "--verify", action="store_true", help="check the newest snapshot's CRCs and record it (the agent's)"
    )
    ap.add_argument("--step", type=int, help="with --verify: only when the newest is still this step")
    a = ap.parse_args(argv)
    if a.verify:
        # the agent's, once its old workers are gone: the next restore from this node skips the pass
        processes.die_with_parent()
        t0 = time.monotonic()
        store = SnapshotStore(a.snapshot_dir, a.name)
        n = store.newest() if a.step is not None else None
        if n is not None and n.step != a.step:  # new workers wrote since: their restore is done
            print(
                f"petctl verify: step {a.step} superseded by step {n.step}: no pass",
                file=sys.stderr,
                flush=True,
            )
            return 0
        c = store.verify()
        how = "sealed by its writer, no pass" if c is not None and store.sealed(c) else "checked"
        what = f"step {c.step} (slot {c.slot}) {how}" if c is not None else "nothing recorded"
        print(f"petctl verify: {what} in {time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)
        return 0
    if a.serve:
        processes.die_with_parent()
        # before _yield_cpu: its threads keep the agent's priority (niceness is per thread on
        # Linux, inherited by the threads a thread starts): a newcomer's fetch is on the job's path
        server = _start_server(Path(a.snapshot_dir), a.name)
        _yield_cpu()
        try:
            return serve(Path(a.snapshot_dir), a.name, server=server)
        finally:
            if server is not None:
                server.close()
    if not a.checkpoint_dir:
        ap.error("CHECKPOINT_DIR is needed without --serve")
    _yield_cpu()
    store = SnapshotStore(a.snapshot_dir, a.name)
    d = Path(a.checkpoint_dir)
    while True:
        try:
            step = persisting.persist_newest(store, d, a.keep)
            if step is not None:
                print(f"petctl persist: step {step} -> {d}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - keep going: the next snapshot may well persist
            print(f"petctl persist: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if a.once:
            return 0
        time.sleep(a.poll)


if __name__ == "__main__":
    sys.exit(main())
