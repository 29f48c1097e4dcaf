"""Worker output: follow torch's per-rank log files, echo them on the agent's
stdout, and ship them to CloudWatch Logs from a background thread.

torch's ``LocalElasticAgent`` with ``redirects=Std.ALL`` writes
``<log_dir>/<run>/attempt_<n>/<local_rank>/{stdout,stderr}.log``; we follow
every such file (new attempts appear on each restart).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("petctl_agent.logs")

Sink = Callable[[str, str], None]  # (source label, line)

# CloudWatch PutLogEvents limits (moto enforces none of them; the local cloud's patches do):
MAX_BATCH_BYTES = 1_048_576  # sum of the messages' UTF-8 bytes + EVENT_OVERHEAD per event
MAX_BATCH_EVENTS = 10_000
MAX_EVENT_BYTES = 256 * 1024  # one event, overhead included
EVENT_OVERHEAD = 26
# A line end is \n, \r\n or a lone \r: progress bars redraw with \r and must not become one
# ever-growing event.
_LINE_END = re.compile(rb"\r\n|\r|\n")


def split_event(message: str, limit: int = MAX_EVENT_BYTES - EVENT_OVERHEAD) -> list[str]:
    """``message`` in pieces of at most ``limit`` UTF-8 bytes, never cutting a character."""
    data = message.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return [message]
    pieces, i = [], 0
    while i < len(data):
        j = min(i + limit, len(data))
        while j < len(data) and j > i and (data[j] & 0xC0) == 0x80:  # inside a multi-byte character
            j -= 1
        pieces.append(data[i:j].decode("utf-8", errors="replace"))
        i = j
    return pieces


class _Tail:
    """One followed file: kept open, so its inode can't be reused while we may still read it."""

    __slots__ = ("f", "ino", "off", "partial", "head")

    def __init__(self, f: Any, ino: int) -> None:
        self.f, self.ino, self.off = f, ino, 0
        self.partial = b""
        self.head = b""  # first bytes read, to notice the file truncated and rewritten in place


class LogTailer:
    """Polls a log root for worker stdout/stderr files and emits complete lines.

    Every file stays open while it is followed. torch rmtree()s and re-creates
    ``attempt_<n>/`` when the restart count is unchanged (a membership change); through the
    open descriptor the old file is read to its end, and its last line emitted even without a
    newline (a worker killed between ``print``'s text and its ``\\n``), before the new file is
    read from its start. An open file's inode can't be given to the new file, so a changed
    inode number always means a new file (closed, a file re-created at once often got the old
    number back, and its first lines were skipped).
    """

    def __init__(self, root: str | os.PathLike, sinks: list[Sink], interval: float = 0.2) -> None:
        self.root = Path(root)
        self.sinks = sinks
        self.interval = interval
        self._tails: dict[Path, _Tail] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # poll() runs in the tail thread and, before a restart, the agent's
        self._thread = threading.Thread(target=self._run, name="petctl-logtail", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Read every file to its end, emit unterminated last lines, close the files."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            try:
                self._poll()
            finally:
                for path in list(self._tails):
                    self._finish(path, self._tails.pop(path))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - never let log tailing kill the agent
                log.debug("log tail error: %s", e)
            self._stop.wait(self.interval)

    def poll(self) -> None:
        """Emit every complete line written since the last poll (thread-safe)."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        seen = set()
        for path in sorted(self.root.glob("**/std*.log")):
            seen.add(path)
            try:
                ino = path.stat().st_ino
            except OSError:
                continue  # removed since the listing: finished below
            tail = self._tails.get(path)
            if tail is not None and tail.ino != ino:
                self._finish(path, self._tails.pop(path))  # re-created: the old file to its end first
                tail = None
            if tail is None:
                try:
                    f = open(path, "rb")  # noqa: SIM115 - stays open while followed
                except OSError:
                    continue
                tail = self._tails[path] = _Tail(f, os.fstat(f.fileno()).st_ino)
            self._read(path, tail)
        for path in [p for p in self._tails if p not in seen]:
            self._finish(path, self._tails.pop(path))  # deleted: what it still holds, through our fd

    def _read(self, path: Path, tail: _Tail) -> None:
        size = os.fstat(tail.f.fileno()).st_size
        if size < tail.off or (tail.off and tail.head and not self._same_head(tail)):
            # truncated (and maybe rewritten) in place: what was pending was its last line
            self._emit(path, [tail.partial] if tail.partial else [])
            tail.off, tail.partial, tail.head = 0, b"", b""
        if size <= tail.off:
            return
        if not tail.head:
            tail.f.seek(0)
            tail.head = tail.f.read(64)
        tail.f.seek(tail.off)
        chunk = tail.f.read(size - tail.off)
        tail.off += len(chunk)
        data = tail.partial + chunk
        # A trailing \r may be the first half of \r\n: decide when the next bytes come.
        held = b"\r" if data.endswith(b"\r") else b""
        *lines, rest = _LINE_END.split(data[: len(data) - len(held)])
        tail.partial = rest + held
        self._emit(path, lines)

    @staticmethod
    def _same_head(tail: _Tail) -> bool:
        tail.f.seek(0)
        return tail.f.read(len(tail.head)) == tail.head

    def _finish(self, path: Path, tail: _Tail) -> None:
        """The file is complete (replaced, deleted, or the agent is done): read it to its end and
        emit its last line even without a newline, then close it."""
        try:
            self._read(path, tail)
            last = tail.partial.rstrip(b"\r")
            if last:
                self._emit(path, [last])
        except OSError as e:
            log.debug("log tail of %s: %s", path, e)
        finally:
            tail.f.close()

    def _emit(self, path: Path, lines: list[bytes]) -> None:
        label = f"{path.parent.parent.name}/rank{path.parent.name}/{path.stem.replace('std', '')}"
        for raw in lines:
            line = raw.decode(errors="replace")
            for sink in self.sinks:
                try:
                    sink(label, line)
                except Exception:  # noqa: BLE001
                    pass


def stdout_sink(prefix: str) -> Sink:
    lock = threading.Lock()

    def sink(label: str, line: str) -> None:
        with lock:
            sys.stdout.write(f"[{prefix} {label}] {line}\n")
            sys.stdout.flush()

    return sink


class CloudWatchShipper:
    """Batches lines to CloudWatch Logs (``put_log_events``) from a daemon thread.

    Every batch keeps PutLogEvents' limits (bytes, events, event size; lines longer than an
    event are split). Tolerant, but honest: nothing lost goes uncounted. :attr:`lost` counts
    lines by cause -- ``rejected`` (accepted call, events refused in ``rejectedLogEventsInfo``:
    too old, too new, expired), ``throttled`` (``ThrottlingException`` after botocore's
    retries), ``failed`` (any other error; the batch is dropped) and ``queue_full`` (the
    bounded queue, so a dead endpoint never grows memory on a days-long run). A change is
    handed to ``on_lost`` (the agent publishes it in its status document) and logged in one
    line at most every ``log_every`` seconds.
    (watchtower was considered: its queue is unbounded, it truncates long lines instead of
    splitting them, and it keeps no count of what it dropped.)
    """

    def __init__(
        self,
        group: str,
        stream: str,
        client_factory: Callable[[], Any],
        interval: float = 2.0,
        max_queue: int = 100_000,
        on_lost: Callable[[dict[str, int]], None] | None = None,
        log_every: float = 60.0,
    ) -> None:
        self.group, self.stream = group, stream
        self._factory = client_factory
        self._client: Any = None
        self.interval = interval
        self._q: queue.Queue[tuple[int, str]] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._stream_ready = False
        self._pending: tuple[int, str] | None = None  # did not fit the last batch
        self._last_err = -float("inf")
        self._lost_lock = threading.Lock()
        self.lost: dict[str, int] = dict.fromkeys(LOST_CAUSES, 0)
        self._on_lost = on_lost
        self._log_every = log_every
        self._thread = threading.Thread(target=self._run, name="petctl-cwlogs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Lines not stored in CloudWatch Logs, all causes."""
        return sum(self.lost.values())

    def _count(self, cause: str, n: int, why: str) -> None:
        if n <= 0:
            return
        with self._lost_lock:
            self.lost[cause] += n
            snapshot = dict(self.lost)
            say = time.monotonic() - self._last_err >= self._log_every
            if say:
                self._last_err = time.monotonic()
        if say:
            log.warning(
                "CloudWatch Logs: %d lines not shipped so far (%s); latest: %s",
                sum(snapshot.values()),
                ", ".join(f"{k} {v}" for k, v in snapshot.items() if v),
                why,
            )
        if self._on_lost is not None:
            try:
                self._on_lost(snapshot)
            except Exception:  # noqa: BLE001 - reporting must not stop shipping
                pass

    def sink(self, label: str, line: str) -> None:
        if not line:
            return  # CloudWatch refuses empty messages
        now = int(time.time() * 1000)
        for piece in split_event(f"[{label}] {line}"):
            try:
                self._q.put_nowait((now, piece))
            except queue.Full:
                self._count("queue_full", 1, "the queue is full (CloudWatch Logs too slow or unreachable)")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(self.interval)
            self.flush()

    def stop(self, timeout: float = 30) -> None:
        """Send what is queued, then return. The thread may be in the middle of a batch: wait
        for it (bounded: a node leaving must not hang on a dead endpoint), since the agent
        exits next and a daemon thread's batch in flight would be lost with it."""
        self._stop.set()
        self._thread.join(timeout=timeout)
        self.flush()

    def _next_batch(self) -> list[tuple[int, str]]:
        """Queued events up to PutLogEvents' count and byte limits (the rest wait for the next)."""
        batch: list[tuple[int, str]] = []
        size = 0
        while len(batch) < MAX_BATCH_EVENTS:
            try:
                item = self._pending or self._q.get_nowait()
            except queue.Empty:
                break
            self._pending = None
            cost = len(item[1].encode("utf-8", errors="replace")) + EVENT_OVERHEAD
            if batch and size + cost > MAX_BATCH_BYTES:
                self._pending = item
                break
            batch.append(item)
            size += cost
        batch.sort(key=lambda e: e[0])  # a batch must be in time order (clocks can step back)
        return batch

    def flush(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch or not self._send(batch):
                return

    def _send(self, batch: list[tuple[int, str]]) -> bool:
        try:
            if self._client is None:
                self._client = self._factory()
            if not self._stream_ready:
                try:
                    self._client.create_log_stream(logGroupName=self.group, logStreamName=self.stream)
                except self._client.exceptions.ResourceAlreadyExistsException:
                    pass
                self._stream_ready = True
            resp = self._client.put_log_events(
                logGroupName=self.group,
                logStreamName=self.stream,
                logEvents=[{"timestamp": t, "message": m} for t, m in batch],
            )
        except Exception as e:  # noqa: BLE001 - log shipping is best effort, but counted
            code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
            if code in THROTTLE_CODES:
                self._count("throttled", len(batch), f"throttled ({code}) after retries, batch dropped")
            else:
                self._count("failed", len(batch), f"{e}")
            return False
        n, why = rejected_count(resp.get("rejectedLogEventsInfo") or {}, len(batch))
        self._count("rejected", n, f"{n} events refused ({why})")
        return True


LOST_CAUSES = ("rejected", "throttled", "failed", "queue_full")
# botocore's standard retry mode retries these; what still fails after the retries is counted
THROTTLE_CODES = frozenset(
    {
        "ThrottlingException",
        "Throttling",
        "ThrottledException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
    }
)


def rejected_count(info: dict[str, Any], n: int) -> tuple[int, str]:
    """Events of an ``n``-event batch that PutLogEvents refused, and why (``rejectedLogEventsInfo``).

    Per the API reference: events ``[0, tooOldLogEventEndIndex)`` are too old (over 14 days),
    ``[tooNewLogEventStartIndex, n)`` too new (over 2 hours ahead), ``[0, expiredLogEventEndIndex)``
    older than the group's retention. The ranges may overlap; each event counts once.
    """
    old = min(int(info.get("tooOldLogEventEndIndex") or 0), n)
    expired = min(int(info.get("expiredLogEventEndIndex") or 0), n)
    new_start = info.get("tooNewLogEventStartIndex")
    new = n - max(int(new_start), max(old, expired)) if new_start is not None else 0
    why = [w for w, k in (("too old", old), ("expired", expired), ("too new", new)) if k > 0]
    return max(old, expired) + max(new, 0), ", ".join(why)
