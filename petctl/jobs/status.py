"""What ``petctl status`` reports, as types: :class:`JobStatus` and its :class:`Host`,
:class:`AgentStatus` and :class:`BootFailures`. ``to_dict()`` gives the ``--output json``
documents of docs/cli.md; :mod:`petctl.jobs.state` derives them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINAL_STATES = ("SUCCEEDED", "FAILED", "GONE", "DELETING")

#: The agent-side fields a host row of ``status`` shows.
AGENT_FIELDS = ("world_size", "round", "restarts", "last_step", "last_checkpoint_step", "reason")


@dataclass
class AgentStatus:
    """One agent's report (``status/<instance-id>.json``); ``raw`` keeps fields petctl does not read."""

    raw: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    @property
    def instance_id(self) -> str | None:
        return self.raw.get("instance_id")

    @property
    def state(self) -> str | None:
        return self.raw.get("state")

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.raw.get("events") or []

    def to_dict(self) -> dict[str, Any]:
        return self.raw


@dataclass
class Host:
    """An instance of the job: what its group and EC2 say, and what its agent reports.

    A host of the warm pool (``Warmed:*``) is shown as ``WARMED``: it is stopped, never joins the
    rendezvous and is no running capacity. A draining host the group no longer lists is
    ``draining_only`` (known from its agent's report alone).
    """

    role: str
    instance_id: str | None
    lifecycle_state: str | None
    availability_zone: str | None = None
    health: str | None = None
    instance_type: str | None = None
    private_ip: str | None = None
    spot: bool = False
    ssm: str | None = None
    agent: dict[str, Any] | None = None
    draining_only: bool = False

    @property
    def warmed(self) -> bool:
        return (self.lifecycle_state or "").startswith("Warmed:")

    @property
    def agent_state(self) -> str | None:
        if self.warmed:
            return "WARMED"
        return (self.agent or {}).get("state")

    def to_dict(self) -> dict[str, Any]:
        """``list-hosts`` rows, and with the agent's fields once ``agent`` is set (``status``)."""
        if self.draining_only:
            a = self.agent or {}
            row = {"role": self.role, "instance_id": self.instance_id, "private_ip": self.private_ip}
            row |= {"lifecycle_state": self.lifecycle_state, "agent_state": "DRAINING"}
            return row | {k: a.get(k) for k in AGENT_FIELDS if k != "last_checkpoint_step"}
        row = {
            "role": self.role,
            "instance_id": self.instance_id,
            "availability_zone": self.availability_zone,
            "lifecycle_state": self.lifecycle_state,
            "health": self.health,
            "instance_type": self.instance_type,
            "private_ip": self.private_ip,
            "spot": self.spot,
            "ssm": self.ssm,
        }
        if self.agent is None:
            return row
        return row | {"agent_state": self.agent_state} | {k: self.agent.get(k) for k in AGENT_FIELDS}


@dataclass
class BootFailures:
    """The boot logs failing instances published: how many, and the newest one's last lines."""

    count: int = 0
    instance_id: str | None = None
    at: str | None = None
    last_lines: list[str] = field(default_factory=list)
    #: The newest failing boot's first error line (what its script published, else found in
    #: ``last_lines``).
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "instance_id": self.instance_id,
            "at": self.at,
            "last_lines": self.last_lines,
            "error": self.error,
        }


@dataclass
class JobStatus:
    job: str
    state: str
    reason: str | None
    boot_failures: BootFailures
    boot_events: list[dict[str, Any]]
    stack_status: str
    min: int | None
    max: int | None
    desired: int | None
    in_service: int
    world_size: int | None
    last_step: int | None
    last_checkpoint_step: int | None
    restarts: int
    log_events_lost: dict[str, int]
    rounds: int
    reports_progress: bool
    uptime_s: float | None
    hosts: list[Host]
    agents: list[AgentStatus]
    events: list[dict[str, Any]]
    #: one line while etcd refuses writes for space (an agent's newest rdzv_no_space), else None
    etcd_alarm: str | None = None
    #: nodes that left the job because failed rounds in a row began on them, one line each
    excluded: list[str] = field(default_factory=list)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "state": self.state,
            # Why a job failed, one line (never empty when FAILED): the stack's reason, the newest
            # failing boot's first error line, or the first failed agent's reason.
            "reason": self.reason,
            "boot_failures": self.boot_failures.to_dict(),
            "boot_events": self.boot_events,
            "stack_status": self.stack_status,
            "min": self.min,
            "max": self.max,
            "desired": self.desired,
            "in_service": self.in_service,
            "world_size": self.world_size,
            "last_step": self.last_step,
            "last_checkpoint_step": self.last_checkpoint_step,
            "restarts": self.restarts,
            # Worker lines the agents could not store in CloudWatch Logs, summed, by cause.
            "log_events_lost": self.log_events_lost,
            "rounds": self.rounds,
            # A script that does not use the checkpoint helper reports no step: say so, not '-'.
            "reports_progress": self.reports_progress,
            "uptime_s": self.uptime_s,
            "hosts": [h.to_dict() for h in self.hosts],
            "agents": [a.to_dict() for a in self.agents],
            "events": self.events,
            "etcd_alarm": self.etcd_alarm,
            "excluded": self.excluded,
        }
