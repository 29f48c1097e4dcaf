"""The errors of the etcd v3 client (:mod:`.etcdv3`, which re-exports them): one family,
:class:`EtcdError`."""

from __future__ import annotations


class EtcdError(Exception):
    """Every error of this client."""


class Unavailable(EtcdError):
    """No answer from etcd (refused, reset, closed, TLS failure): the call may or may not have
    been applied; retry, then re-read what it changed."""


class Timeout(Unavailable):
    """etcd did not answer within the call's timeout."""


class Silent(Unavailable):
    """A watch received nothing (no event, no progress notification) for its ``silence``: its
    connection is taken as dead. Watch again (on a new connection) from the last revision seen."""


class RequestFailed(EtcdError):
    """etcd answered with an error (``code`` is the gRPC status code, ``status`` the HTTP one)."""

    def __init__(self, message: str, code: int = 0, status: int = 0) -> None:
        super().__init__(message)
        self.code, self.status = code, status


class LeaseNotFound(RequestFailed):
    """The lease expired or was revoked (or never existed)."""


class NoSpace(RequestFailed):
    """etcd's backend is at its quota (``--quota-backend-bytes``) and its NOSPACE alarm is
    raised: every write fails (reads, watches and keepalives go on) until the history is
    compacted, the database defragmented and the alarm disarmed (docs/rendezvous.md)."""


class Compacted(EtcdError):
    """The revision asked for is compacted away; ``compact_revision`` is the oldest etcd keeps
    (0 when etcd did not say). Re-read the state once and watch from that read's revision + 1."""

    def __init__(self, message: str, compact_revision: int = 0) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class ClusterChanged(EtcdError):
    """Another etcd answers this address now: another cluster id, or the same cluster (etcd
    derives the id from its member names and peer URLs, so a fresh data dir on the same
    address keeps it) whose store revision went back below one this client saw before the
    request. Revisions, leases and views from before mean nothing. Raised once per change;
    the client then follows the new etcd."""

    def __init__(self, message: str, old: int, new: int) -> None:
        super().__init__(message)
        self.old, self.new = old, new
