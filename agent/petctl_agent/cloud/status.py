"""Agent status publishing (``status/<instance-id>.json``, version 1 of docs/contracts.md).

The writer is pluggable: ``s3://bucket/prefix/`` (boto3 ``put_object``) or
``file:///dir/`` (tests, the local cloud). Publishing is throttled (each state
change, else every ``interval`` seconds) and never fatal: failures are logged.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

log = logging.getLogger("petctl_agent.status")

STATES = ("STARTING", "WARMED", "RENDEZVOUS", "RUNNING", "DRAINING", "LEFT", "SUCCEEDED", "FAILED")
EVENT_KINDS = (
    "agent_started",
    "workers_ready",
    "rendezvous_start",
    "rendezvous_done",
    "workers_started",
    "workers_failed",
    "drain_requested",
    "drained",
    "excluded",
    "rdzv_unreachable",
    "rdzv_recovered",
    "rdzv_no_space",
    "rdzv_space_ok",
    "succeeded",
    "failed",
    "snapshot_off",
    "snapshot_restored",
    "snapshot_fallback",
    "snapshot_persist_failed",
)
MAX_EVENTS = 200


class StatusWriter(Protocol):
    def write(self, name: str, body: bytes) -> None: ...


class FileStatusWriter:
    """Writes ``<dir>/<name>`` atomically (temp + rename)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)

    def write(self, name: str, body: bytes) -> None:
        target = self.dir / name  # a name may have a sub-directory: boot/progress/mark
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
        tmp.write_bytes(body)
        os.replace(tmp, target)


class S3StatusWriter:
    def __init__(self, bucket: str, prefix: str, client_factory: Callable[[], Any]) -> None:
        self.bucket, self.prefix = bucket, prefix
        self._factory = client_factory
        self._client: Any = None

    def write(self, name: str, body: bytes) -> None:
        if self._client is None:
            self._client = self._factory()
        self._client.put_object(
            Bucket=self.bucket, Key=f"{self.prefix}{name}", Body=body, ContentType="application/json"
        )


class NullStatusWriter:
    def write(self, name: str, body: bytes) -> None:
        pass


def make_writer(status_url: str, client_factory: Callable[[], Any] | None = None) -> StatusWriter:
    """Writer for ``status_url`` (``s3://``, ``file://``, a plain path, or empty = none)."""
    if not status_url:
        return NullStatusWriter()
    u = urlparse(status_url)
    if u.scheme == "s3":
        from petctl_agent.cloud import aws

        prefix = u.path.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return S3StatusWriter(u.netloc, prefix, client_factory or (lambda: aws.client("s3")))
    return FileStatusWriter(u.path if u.scheme == "file" else status_url)


class StatusPublisher:
    """Holds the agent's status document and publishes it from a background thread."""

    def __init__(
        self,
        writer: StatusWriter,
        job_name: str,
        instance_id: str,
        private_ip: str,
        interval: float = 5.0,
        refresh: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.writer = writer
        self.name = f"{instance_id}.json"
        self.interval = interval
        self.refresh = refresh
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dirty = True
        self._last_error_log = 0.0
        self.doc: dict[str, Any] = {
            "version": 1,
            "job_name": job_name,
            "instance_id": instance_id,
            "private_ip": private_ip,
            "state": "STARTING",
            "world_size": None,
            "round": None,
            "restarts": 0,
            "last_step": None,
            "last_checkpoint_step": None,
            "reason": None,
            "log_events_lost": None,  # CloudWatchShipper.lost: lines not stored, by cause
            "updated_at": time.time(),
            "events": [],
        }
        self._thread = threading.Thread(target=self._run, name="petctl-status", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def update(self, **fields: Any) -> None:
        """Set fields; a change of ``state`` publishes at once."""
        with self._lock:
            state_changed = "state" in fields and fields["state"] != self.doc["state"]
            self.doc.update(fields)
            self._dirty = True
        if state_changed:
            log.info(
                "state -> %s%s", fields["state"], f" ({fields['reason']})" if fields.get("reason") else ""
            )
            self._wake.set()

    def event(self, kind: str, **data: Any) -> None:
        """Append an event (``t`` = now) and publish at once."""
        ev = {"t": time.time(), "kind": kind, **data}
        with self._lock:
            self.doc["events"] = (self.doc["events"] + [ev])[-MAX_EVENTS:]
            self._dirty = True
        log.info("event %s %s", kind, json.dumps(data, default=str))
        self._wake.set()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self.doc, default=str))

    def flush(self) -> None:
        """Publish now (synchronously)."""
        if self.refresh is not None:
            try:
                extra = self.refresh()
            except Exception:  # noqa: BLE001
                extra = {}
            with self._lock:
                self.doc.update(extra)
        with self._lock:
            self.doc["updated_at"] = time.time()
            body = json.dumps(self.doc, default=str).encode()
            self._dirty = False
        try:
            self.writer.write(self.name, body)
        except Exception as e:  # noqa: BLE001 - status is best effort
            if time.monotonic() - self._last_error_log > 30:
                log.warning("status publish failed (will retry): %s", e)
                self._last_error_log = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()
