"""An etcd v3 watch (:class:`Watch`, what :meth:`~.etcdv3.Client.watch` returns): a stream on
its own connection, read by a daemon thread; :meth:`Watch.get` hands out each answer's events in
order, with a timeout. A compacted start revision, a cancel by etcd, a broken stream or one
silent too long end it with the client's error (:class:`Compacted`, :class:`RequestFailed`,
:class:`Unavailable`, :class:`Silent`).
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from petctl_agent.rendezvous.errors import Compacted, EtcdError, RequestFailed, Silent, Timeout, Unavailable
from petctl_agent.rendezvous.etcd_transport import API, Transport, _error
from petctl_agent.rendezvous.etcd_types import Event, Header, KeyValue

_END = object()


@dataclass
class _WatchState:
    error: EtcdError | None = None
    watch_id: int = -1
    events: queue.Queue = field(default_factory=queue.Queue)


class Watch:
    """A streaming watch: a daemon thread reads etcd's answers, :meth:`get` hands them out.

    Each answer's events come in revision order, none skipped from the start revision on. A
    compacted start revision, a cancel by etcd, or a broken stream end the watch: :meth:`get`
    then raises (:class:`Compacted` for the first; re-read with :meth:`Client.range`, watch
    again from its revision + 1). A stream that carried nothing for ``silence`` seconds ends
    it too (:class:`Silent`): a quiet key sends nothing, but etcd sends a progress
    notification on a quiet watch every interval (``--experimental-watch-progress-notify-
    interval``), so a live stream is never that silent and a silent one is a dead connection
    (a dropped NAT or connection-tracking entry sends no FIN nor RST: docs/rendezvous.md).
    Resume from :attr:`last_event_revision` + 1: nothing lost, nothing repeated (etcd never
    splits one revision's events between two answers). :meth:`close` ends it, and
    :meth:`get` always returns in time.
    """

    def __init__(self, client: Transport, body: dict[str, Any], timeout: float, silence: float = 0.0) -> None:
        self.client = client
        self.silence = silence
        self.revision = 0  #: the header revision of the latest answer: all before it was delivered
        #: the mod revision of the last event handed out by :meth:`get` (0: none yet)
        self.last_event_revision = 0
        self.last_message = time.monotonic()  #: when the stream last carried an answer
        self.progress = 0  #: progress notifications received (answers with no event)
        self._state = _WatchState()
        self._closed = threading.Event()
        self._created = threading.Event()
        self._conn = client._new_conn(timeout)
        data = json.dumps(body).encode()
        try:
            self._conn.request(
                "POST", f"{API}/watch", body=data, headers={"Content-Type": "application/json"}
            )
            self._resp = self._conn.getresponse()
            if self._resp.status != 200:
                raw = self._resp.read()
                self._conn.close()
                client._answer(raw, self._resp.status, "watch")
        except TimeoutError as e:
            self._conn.close()
            raise Timeout(f"etcd {client.url}: no answer to watch within {timeout:g}s") from e
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise Unavailable(f"etcd {client.url}: watch failed: {e or type(e).__name__}") from e
        client.stats.add("watch", len(data), 0)
        self._thread = threading.Thread(target=self._read, name="etcd-watch", daemon=True)
        self._thread.start()
        if not self._created.wait(timeout):
            self.close()
            raise Timeout(f"etcd {client.url}: watch not created within {timeout:g}s")
        if self._state.error is not None and self._state.watch_id < 0:
            self.close()
            raise self._state.error

    def _read(self) -> None:
        st = self._state
        try:
            # a watch closed before this thread ran (its creation timed out under load) has no socket
            sock = self._conn.sock
            if sock is None:
                raise Unavailable(f"etcd {self.client.url}: watch closed before it was read")
            # a live watch carries a progress notification every interval: silence is death
            sock.settimeout(self.silence if self.silence > 0 else None)
            for line in self._lines():
                self.last_message = time.monotonic()
                d = json.loads(line)
                if "error" in d and "result" not in d:
                    err = d["error"]
                    raise _error(
                        err if isinstance(err, dict) else {"message": err},
                        500,
                        f"etcd {self.client.url}: watch",
                    )
                r = d.get("result") or {}
                self.client.stats.add("watch-answer", 0, len(line))
                self.client._check_cluster(r.get("header"))
                compact = int(r.get("compact_revision", 0) or 0)
                if compact:
                    raise Compacted(
                        f"etcd {self.client.url}: watch: revision compacted (oldest kept: {compact})", compact
                    )
                if r.get("canceled"):
                    raise RequestFailed(
                        f"etcd {self.client.url}: watch canceled: {r.get('cancel_reason', '')}"
                    )
                if r.get("created"):
                    st.watch_id = int(r.get("watch_id", 0))
                    self._created.set()
                evs = [
                    Event(
                        e.get("type", "PUT"),
                        KeyValue.parse(e.get("kv") or {}),
                        KeyValue.parse(e["prev_kv"]) if e.get("prev_kv") else None,
                    )
                    for e in r.get("events", [])
                ]
                if evs:  # the created answer and progress notices carry none
                    st.events.put((Header.parse(r.get("header")).revision, evs))
                elif not r.get("created"):
                    self.progress += 1
            raise Unavailable(f"etcd {self.client.url}: watch stream ended")
        except EtcdError as e:
            st.error = e
        except TimeoutError:
            st.error = Silent(
                f"etcd {self.client.url}: watch silent for {self.silence:g}s (no event, no progress "
                "notification): its connection is taken as dead"
            )
        except Exception as e:  # noqa: BLE001 (a closed or broken stream, whatever http.client says)
            st.error = Unavailable(f"etcd {self.client.url}: watch stream broke: {e or type(e).__name__}")
        finally:
            if self._closed.is_set():
                st.error = Unavailable(f"etcd {self.client.url}: watch closed")
            self._created.set()
            st.events.put(_END)

    def _lines(self) -> Iterable[bytes]:
        # the gateway writes one JSON object per message, each followed by a newline
        buf = b""
        while True:
            chunk = self._resp.read1(65536)
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            yield from (ln for ln in lines if ln.strip())

    def get(self, timeout: float) -> list[Event] | None:
        """The events of etcd's next answer (in order), or ``None`` if none came within
        ``timeout``. Raises the error that ended the watch (after every event before it)."""
        try:
            item = self._state.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if item is _END:
            self._state.events.put(_END)  # every later get raises too
            assert self._state.error is not None
            raise self._state.error
        rev, evs = item
        self.revision = max(self.revision, rev)
        self.last_event_revision = max(self.last_event_revision, evs[-1].kv.mod_revision)
        return evs

    def events(self, timeout: float) -> Iterable[Event]:
        """Every event until ``timeout`` seconds pass without one (a convenience for tests)."""
        while True:
            evs = self.get(timeout)
            if evs is None:
                return
            yield from evs

    def close(self) -> None:
        """End the watch: the reader thread sees its socket shut and stops (joined, bounded)."""
        self._closed.set()
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not threading.current_thread():
            self._thread.join(2)
        self._conn.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
