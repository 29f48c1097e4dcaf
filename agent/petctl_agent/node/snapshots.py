"""The node's memory-snapshot store, owned by the agent: made before the workers start, kept across
their restarts, freed when the node leaves the job or the job ends (docs/agent.md, "Memory snapshots").

``<PETCTL_AGENT_SNAPSHOT_DIR>/<job>/<instance-id>`` (default ``/dev/shm/petctl/...``, mode 0700): one
directory per node, so several local-cloud "instances" on one machine never share one. The agent:

- checks the base is on a tmpfs (else: off, with a ``snapshot_off`` event);
- removes what a previous agent of this instance left (a node that joins starts empty), and any
  sibling store no live agent holds (its ``owner.lock`` is free: an agent that was SIGKILLed);
- starts the persister (``python -m petctl_agent.checkpointing.persist --serve DIR replicated``), a
  child process that outlives worker restarts and writes the snapshot a worker asks for to EFS;
- publishes the workers' reports as events: ``snapshot_restored`` (``restore.json``: source
  ``self``/``peer``/``efs``, step, bytes, seconds), ``snapshot_fallback`` (``fallback.json``: the
  node's memory could not hold a snapshot, the step went to EFS the slow way) and
  ``snapshot_persist_failed`` (``persist.json`` with an error);
- serves the store to peers (the persister's thread, on this node's address) and, when a round
  closes and this node holds no snapshot (it joins), fetches the peers' newest into it while its
  workers start (:meth:`SnapshotArea.after_round`; ``checkpointing/fetch.py``); its workers'
  restore waits for that fetch (``fetch.lock``), then finds the step at home;
- at the end stops the persister (SIGTERM: the write in flight ends first, at most
  :data:`STOP_WAIT` s) and removes the directory.

This room never imports ``checkpointing`` (the worker's side): the file names below are the ones
``checkpointing/persist.py`` and ``checkpointing/memory.py`` use (a test holds them equal).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from petctl_agent import filelocks, knobs

log = logging.getLogger("petctl_agent")

NAME = "replicated"
OWNER_LOCK = "owner.lock"
RESTORE_REPORT = "restore.json"
FALLBACK_REPORT = "fallback.json"
PERSIST_STATE = "persist.json"
#: optional fields of ``restore.json`` passed on in ``snapshot_restored``: a peer's copy kept in
#: this node's store (seconds), and the sharded path's per-shard sources and the step gone back to
#: ``received``: bytes a sharded restore took from peers; ``reason``: why it went to EFS instead
RESTORE_EXTRAS = ("kept_seconds", "shards", "newest", "back_to", "received", "reason")
#: the persister's snapshot server's address, and the lock held while a fetch fills the store
#: (``checkpointing/fetch.py``'s ``SERVE_FILE`` and ``FETCH_LOCK``)
SERVE_FILE = "serve.json"
FETCH_LOCK = "fetch.lock"
#: the round store's key of a node's snapshot server (``<KEY><group rank>``: ``host:port``, or empty)
SERVER_KEY = "petctl/snapshot_server/"
#: peers a fetch asks for their newest snapshot (the next group ranks after ours): enough sources
#: for every stripe, without asking hundreds of nodes
FETCH_PEERS = 8
#: seconds a fetch waits for the peers' servers to appear in the round store (they publish them as
#: the round closes for them too); past it, those that did
SERVERS_WAIT = 2.0


def fetch_deadline() -> float:
    """Seconds a fetch may take: 3/4 of the workers' wait for it (``PETCTL_SNAPSHOT_PEER_TIMEOUT``,
    60 s: the restore's own bound), so that it is over, or killed, before they stop waiting."""
    return max(1.0, 0.75 * knobs.snapshot_peer_timeout())


#: seconds the persister gets to finish a write in flight when the node leaves
STOP_WAIT = 60.0
TMPFS_TYPES = ("tmpfs",)


def fs_type(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """The filesystem type of the mount that holds ``path`` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    p = p.resolve()
    return filelocks.mount_of(p, mounts)[1]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


class SnapshotArea:
    """One node's store: the directory, its owner lock, the persister and the report watcher."""

    def __init__(
        self, directory: Path, pub: Any = None, poll: float = 0.5, serve_addr: str | None = None
    ) -> None:
        self.dir = Path(directory)
        self.pub = pub
        self.poll = poll
        #: this node's address for its snapshot server; None: no server, no fetch (peers use gloo)
        self.serve_addr = serve_addr
        #: what a peer's request must carry (published in the round's store, which only the job's
        #: agents read: etcd with client certificates on AWS)
        self.token = secrets.token_hex(16)
        self.fetcher: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the fetch's start against close()
        self._lock_fd: int | None = None
        self.persister: subprocess.Popen[bytes] | None = None
        self._seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.verifier: subprocess.Popen[bytes] | None = None

    @classmethod
    def open(
        cls, base: str | os.PathLike, job: str, node: str, pub: Any = None, serve_addr: str | None = None
    ) -> SnapshotArea | None:
        """Make the node's store and start its persister; None (and a ``snapshot_off`` event) when
        ``base`` is not on a tmpfs or cannot be made."""
        base = Path(base)
        kind = fs_type(base)
        why = None
        if kind not in TMPFS_TYPES:
            why = f"{base} is on {kind or 'an unknown filesystem'}, not a tmpfs: memory snapshots off, checkpoints go to EFS"
        else:
            try:
                area = cls(base / job / node, pub, serve_addr=serve_addr)
                area._make()
                area.start()
                return area
            except OSError as e:
                why = f"cannot make the snapshot store under {base} ({e.strerror or e}): memory snapshots off"
        log.warning("%s", why)
        if pub is not None:
            pub.event("snapshot_off", reason=why)
        return None

    def _make(self) -> None:
        job_dir = self.dir.parent
        for tries_left in (2, 1, 0):
            try:
                job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                for sib in job_dir.iterdir():  # stores no live agent holds (a SIGKILLed one's)
                    if sib.is_dir() and sib != self.dir and (sib / OWNER_LOCK).exists():
                        if not filelocks.held(sib / OWNER_LOCK):
                            log.info("removing the stale snapshot store %s", sib)
                            shutil.rmtree(sib, ignore_errors=True)
                shutil.rmtree(self.dir, ignore_errors=True)  # this node starts empty
                self.dir.mkdir(mode=0o700)
                break
            except FileNotFoundError:
                # the job's directory went meanwhile: the last other node of the job on this
                # machine (a local cloud's) closed its store and removed it (close())
                if not tries_left:
                    raise
        # locked before it has its name: a sweeper never sees an unlocked owner.lock of a live agent
        tmp = self.dir / f".{OWNER_LOCK}.tmp"
        fd = filelocks.hold(tmp)
        os.replace(tmp, self.dir / OWNER_LOCK)
        self._lock_fd = fd

    @staticmethod
    def _env() -> dict[str, str]:
        import petctl_agent

        root = str(Path(petctl_agent.__file__).resolve().parents[1])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return env

    def start(self) -> None:
        env = self._env()
        if self.serve_addr:
            env["PETCTL_SNAPSHOT_SERVE_ADDR"] = self.serve_addr
            env["PETCTL_SNAPSHOT_SERVE_TOKEN"] = self.token
        self.persister = subprocess.Popen(
            [sys.executable, "-m", "petctl_agent.checkpointing.persist", "--serve", str(self.dir), NAME],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        self._thread = threading.Thread(target=self._watch, name="petctl-snapshots", daemon=True)
        self._thread.start()

    def verify(self) -> None:
        """The node's workers are gone and new ones are about to start: check the newest snapshot's
        CRCs now, in a process of its own (``persist --verify``, dies with the agent), so that the
        new workers' restore from this node skips that pass over the bytes (``SnapshotStore.verify``
        and ``prechecked``; a restore that comes first waits for the verdict). Never blocks."""
        v = self.verifier
        if v is not None and v.poll() is None:
            return  # one is running (nothing has written the store since: no worker runs)
        # the step the old workers left: a verifier that starts late (a loaded machine) finds a new
        # worker's snapshot newest, still being written and sealed by it, and leaves it alone
        step = ["--step", str(self._newest_step())]
        self.verifier = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "petctl_agent.checkpointing.persist",
                "--verify",
                *step,
                str(self.dir),
                NAME,
            ],
            env=self._env(),
            stdin=subprocess.DEVNULL,
        )

    def _newest_step(self) -> int:
        """The newest step this node's store holds a header of (-1: none); cheap, unchecked: only
        whether a joining peer should bother to fetch (the fetch checks everything itself)."""
        steps = [h.get("step") for s in ("a", "b") if (h := _read_json(self.dir / f"{NAME}.{s}.json"))]
        return max((int(s) for s in steps if isinstance(s, int)), default=-1)

    def after_round(self, store: Any, rank: int, world: int) -> None:
        """A round closed (``store``: its rendezvous store; ``rank`` of ``world``: this node's group
        rank): publish this node's snapshot server there (address, token, newest step), and when
        this node holds no snapshot (it joins), start fetching the peers' newest into the store now,
        holding ``fetch.lock`` for it (the workers' restore waits for it). Never blocks: the servers
        are gathered and the fetch started and bounded in a thread; never raises."""
        srv = _read_json(self.dir / SERVE_FILE) if self.serve_addr else None
        mine = self._newest_step()
        me = (
            json.dumps({"addr": srv["addr"], "port": srv["port"], "token": self.token, "step": mine})
            if srv and srv.get("port")
            else ""
        )
        try:
            store.set(f"{SERVER_KEY}{rank}", me)
        except Exception as e:  # noqa: BLE001 - a speed-up only: the restore's own path remains
            log.debug("publishing the snapshot server: %s", e)
        if not me or world < 2 or mine >= 0:
            return
        # non-blocking: a fetch still under way (the last round's) holds it, and its workers wait
        fd = filelocks.try_hold(self.dir / FETCH_LOCK)
        if fd is None:
            return
        peers = [(rank + i) % world for i in range(1, min(world, FETCH_PEERS + 1))]
        threading.Thread(
            target=self._fetch, args=(store, peers, fd), name="petctl-snapshot-fetch", daemon=True
        ).start()

    def _fetch(self, store: Any, peers: list[int], fd: int) -> None:
        """Gather the peers' servers (at most :data:`SERVERS_WAIT` s); if one holds a step, start
        the fetch process, which takes over the lock (the same open file) until it exits, and kill
        it past its deadline, so it never outlives the workers' wait for it (which then restore
        over gloo, writing the store themselves: two writers of one store never run at once)."""
        proc = None
        try:
            keys = [f"{SERVER_KEY}{r}" for r in peers]
            got: dict[str, str] = {}
            t0 = time.monotonic()
            while len(got) < len(keys):
                for k in keys:
                    if k not in got and store.check([k]):
                        got[k] = store.get(k).decode()
                # every server published, or some and the others late: those that did
                if (
                    len(got) == len(keys)
                    or time.monotonic() - t0 > SERVERS_WAIT
                    or (got and time.monotonic() - t0 > 0.3)
                ):
                    break
                time.sleep(0.02)
            srcs = []
            for v in got.values():
                try:
                    s = json.loads(v) if v else None
                except ValueError:
                    s = None
                if isinstance(s, dict) and int(s.get("step", -1)) >= 0:
                    srcs.append(s)
            if not srcs:
                return  # nobody holds a step (a cold start, sharded state): nothing to wait for
            deadline = fetch_deadline()
            with self._lock:
                if self._stop.is_set():
                    return  # the store is being freed: never fill it again
                proc = self.fetcher = subprocess.Popen(
                    [sys.executable, "-m", "petctl_agent.checkpointing.fetch", str(self.dir), NAME,
                     "--deadline", f"{deadline:g}"],
                    env=self._env(),
                    stdin=subprocess.PIPE,
                    pass_fds=(fd,),
                )  # fmt: skip
            os.close(fd)  # the fetch process holds the lock now
            fd = -1
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(srcs).encode())  # the tokens never on a command line
            proc.stdin.close()
            try:
                proc.wait(deadline + 5)
            except subprocess.TimeoutExpired:
                log.warning(
                    "the snapshot fetch ran past %.0f s: killed (the restore gets it over gloo)", deadline
                )
                proc.kill()
                proc.wait()
        except Exception as e:  # noqa: BLE001 - a speed-up only: the restore's own path remains
            log.warning("fetching the peers' snapshot failed (%s): the restore gets it over gloo", e)
            if proc is not None and proc.poll() is None:
                proc.kill()
        finally:
            if fd >= 0:
                os.close(fd)  # nobody fetches: the workers go on

    # ---- reports -> events
    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            self.publish_reports()

    def publish_reports(self) -> None:
        """Publish each report the workers (or the persister) wrote since the last call, once."""
        for name, kind in (
            (RESTORE_REPORT, "snapshot_restored"),
            (FALLBACK_REPORT, "snapshot_fallback"),
            (PERSIST_STATE, "snapshot_persist_failed"),
        ):
            body = _read_json(self.dir / name)
            if not body or self._seen.get(name) == body.get("t"):
                continue
            self._seen[name] = body.get("t")
            if kind == "snapshot_persist_failed":
                if not body.get("error"):
                    continue
                data = {"step": body.get("error_step"), "reason": body["error"]}
            elif kind == "snapshot_fallback":
                data = {
                    "step": body.get("step"),
                    "reason": f"memory snapshot skipped ({body.get('reason')}); step written to EFS",
                }
                log.warning("%s", data["reason"])
            else:  # source, step, bytes, seconds, and what else the restore said (docs/contracts.md)
                data = {k: body.get(k) for k in ("source", "step", "bytes", "seconds")}
                data.update({k: v for k, v in body.items() if k in RESTORE_EXTRAS})
            if self.pub is not None:
                self.pub.event(kind, **data)

    # ---- the end
    def close(self) -> None:
        """Stop the persister (its write in flight ends first, bounded), publish, remove the store."""
        with self._lock:  # no fetch starts after this
            self._stop.set()
            f, self.fetcher = self.fetcher, None
        if f is not None:
            if f.poll() is None:
                f.kill()  # the store it fills is removed now
            f.wait()
        v, self.verifier = self.verifier, None
        if v is not None:
            if v.poll() is None:
                v.kill()  # only a record for the next restore, which no longer comes
            v.wait()
        p, self.persister = self.persister, None
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                log.warning("persister still writing after %.0fs: killed", STOP_WAIT)
                p.kill()
                p.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.publish_reports()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        try:
            self.dir.parent.rmdir()  # the job's directory, once no node of it is left here
        except OSError:
            pass
