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
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("petctl_agent.logs")

Sink = Callable[[str, str], None]  # (source label, line)


class LogTailer:
    """Polls a log root for worker stdout/stderr files and emits complete lines."""

    def __init__(self, root: str | os.PathLike, sinks: list[Sink], interval: float = 0.2) -> None:
        self.root = Path(root)
        self.sinks = sinks
        self.interval = interval
        self._offsets: dict[Path, tuple[int, int]] = {}  # path -> (inode, offset)
        self._partial: dict[Path, bytes] = {}
        self._heads: dict[Path, bytes] = {}  # first bytes seen, to notice a file recreated in place
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="petctl-logtail", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - never let log tailing kill the agent
                log.debug("log tail error: %s", e)
            self._stop.wait(self.interval)

    def _same_head(self, path: Path) -> bool:
        head = self._heads.get(path)
        if not head:
            return True
        try:
            with open(path, "rb") as f:
                return f.read(len(head)) == head
        except OSError:
            return True

    def poll(self) -> None:
        for path in sorted(self.root.glob("**/std*.log")):
            try:
                st = path.stat()
            except OSError:
                continue
            inode, off = self._offsets.get(path, (st.st_ino, 0))
            if inode != st.st_ino or st.st_size < off or (off and not self._same_head(path)):
                # torch reuses attempt_<restart_count>/ (rmtree + recreate) when the
                # restart count did not change, e.g. after a coordinated drain restart;
                # the new file may even get the old inode number, so its first bytes decide
                off = 0
                self._partial.pop(path, None)
                self._heads.pop(path, None)
            if st.st_size <= off:
                self._offsets[path] = (st.st_ino, off)
                continue
            with open(path, "rb") as f:
                if path not in self._heads:
                    self._heads[path] = f.read(64)
                f.seek(off)
                chunk = f.read(st.st_size - off)
            data = self._partial.pop(path, b"") + chunk
            self._offsets[path] = (st.st_ino, off + len(chunk))
            *lines, rest = data.split(b"\n")
            if rest:
                self._partial[path] = rest
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

    Tolerant: any error is logged (rate-limited) and the batch dropped; the queue
    is bounded so a dead endpoint never grows memory without limit.
    """

    def __init__(
        self,
        group: str,
        stream: str,
        client_factory: Callable[[], Any],
        interval: float = 2.0,
        max_queue: int = 100_000,
    ) -> None:
        self.group, self.stream = group, stream
        self._factory = client_factory
        self._client: Any = None
        self.interval = interval
        self._q: queue.Queue[tuple[int, str]] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._stream_ready = False
        self._last_err = 0.0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="petctl-cwlogs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sink(self, label: str, line: str) -> None:
        try:
            self._q.put_nowait((int(time.time() * 1000), f"[{label}] {line}"))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(self.interval)
            self.flush()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()

    def flush(self) -> None:
        batch: list[tuple[int, str]] = []
        while len(batch) < 5000:
            try:
                batch.append(self._q.get_nowait())
            except queue.Empty:
                break
        if not batch:
            return
        try:
            if self._client is None:
                self._client = self._factory()
            if not self._stream_ready:
                try:
                    self._client.create_log_stream(logGroupName=self.group, logStreamName=self.stream)
                except self._client.exceptions.ResourceAlreadyExistsException:
                    pass
                self._stream_ready = True
            self._client.put_log_events(
                logGroupName=self.group,
                logStreamName=self.stream,
                logEvents=[{"timestamp": t, "message": m} for t, m in batch],
            )
        except Exception as e:  # noqa: BLE001 - log shipping is best effort
            self.dropped += len(batch)
            if time.monotonic() - self._last_err > 30:
                log.warning("CloudWatch Logs shipping failed (%d lines dropped so far): %s", self.dropped, e)
                self._last_err = time.monotonic()
