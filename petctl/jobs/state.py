"""A job's status, derived from facts gathered beforehand: pure, no AWS call, no clock read.

:func:`derive` turns :class:`Facts` (the stack, the worker group, the hosts, what the agents and
boot scripts published) into a :class:`JobStatus`, whose ``to_dict()`` is the ``status --output
json`` document (docs/contracts.md). A new agent state is handled in :func:`overall_state` and
:func:`ever_trained`. What the boots left (their summary and phases) is read in
:mod:`petctl.jobs.boots`; why a FAILED job failed is worded in :mod:`petctl.jobs.reasons`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from petctl.jobs.boots import boot_phases
from petctl.jobs.reasons import agent_failure_reason, boot_failure_reason, stopped_line
from petctl.jobs.status import AgentStatus, BootFailures, Host, JobStatus

#: Boot logs (s3://<bucket>/petctl/jobs/<job>/boot/) after which, with no agent ever training, the
#: job counts as FAILED; the boot scripts scale the groups to zero at the same count (common.sh.j2).
BOOT_FAILURES_TO_FAIL = 3
#: A draining agent out of its group (the group lists it no more, while it checkpoints and
#: leaves) still counts this long after its last report: the longest drain timeout.
DRAINING_GRACE_S = 7200


@dataclass
class Facts:
    """Everything a status is derived from, as gathered (``observe.gather``)."""

    job: str
    stack: dict[str, Any]
    group: dict[str, Any]
    hosts: list[Host]
    reports: list[dict[str, Any]]
    boot: BootFailures
    boot_docs: list[dict[str, Any]]
    now: float


def rounds_formed(agents: list[AgentStatus], events: list[dict[str, Any]]) -> int:
    """Rendezvous rounds the job has formed. A replaced etcd numbers its rounds from the start
    again (a new epoch, as the timeline reads the events): each earlier epoch adds its last round.
    Within one epoch the agents' own round numbers count (exact even when old events are gone)."""
    from petctl.timeline.parse import read_rounds

    last_round: dict[int, int] = {}
    for r in read_rounds(events):
        last_round[r["epoch"]] = max(last_round.get(r["epoch"], 0), r["round"])
    if len(last_round) <= 1:
        return max((a.get("round") or 0 for a in agents), default=0)
    return sum(last_round.values())


def derive(f: Facts) -> JobStatus:
    """The job's status from its facts (docs/contracts.md, Agent status and Boot failures)."""
    agents = [AgentStatus(r) for r in f.reports]
    by_id = {a.instance_id: a for a in agents}
    hosts = list(f.hosts)
    live = {h.instance_id for h in hosts}
    for h in hosts:
        h.agent = by_id.get(h.instance_id, AgentStatus({})).raw
    current = current_agents(f.reports, live, f.now)
    for a in current:
        if a.get("instance_id") not in live and a.get("state") == "DRAINING":
            # Out of the group's list, not gone yet: it is checkpointing and leaving.
            hosts.append(
                Host(
                    role="worker",
                    instance_id=a.get("instance_id"),
                    private_ip=a.get("private_ip"),
                    lifecycle_state="Terminating",
                    agent=a,
                    draining_only=True,
                )
            )
    steps = [a.get("last_step") for a in agents if a.get("last_step") is not None]
    ckpts = [a.get("last_checkpoint_step") for a in agents if a.get("last_checkpoint_step") is not None]
    worlds = [a.get("world_size") for a in current if a.get("state") == "RUNNING" and a.get("world_size")]
    events = sorted(
        ({**e, "instance_id": a.instance_id} for a in agents for e in a.events),
        key=lambda e: e.get("t", 0),
    )
    desired = f.group.get("DesiredCapacity")
    failed_boot = boot_failed(f.boot, ever_trained(f.reports), desired)
    state = overall_state(f.stack["StackStatus"], current, desired, failed_boot)
    return JobStatus(
        job=f.job,
        state=state,
        reason=failure_reason(f, state, failed_boot, current),
        boot_failures=f.boot,
        boot_events=boot_phases(f.boot_docs, f.reports),
        stack_status=f.stack["StackStatus"],
        min=f.group.get("MinSize"),
        max=f.group.get("MaxSize"),
        desired=desired,
        in_service=in_service(f.group),
        world_size=max(worlds) if worlds else None,
        last_step=max(steps) if steps else None,
        last_checkpoint_step=max(ckpts) if ckpts else None,
        restarts=max((a.get("restarts") or 0 for a in agents), default=0),
        log_events_lost=lost_lines(agents),
        rounds=rounds_formed(agents, events),
        reports_progress=bool(steps),
        uptime_s=uptime(f.stack, f.reports, f.now),
        hosts=hosts,
        agents=agents,
        events=events,
        etcd_alarm=etcd_alarm(agents),
        excluded=excluded_nodes(agents),
    )


def excluded_nodes(agents: list[AgentStatus]) -> list[str]:
    """One line per node whose agent left the job because failed rounds in a row began on it
    (its ``excluded`` event; the agent's elastic/culprit.py), oldest first: "node i-0abc excluded
    after 3 failures that began on it (<its last failure>)"."""
    out: list[tuple[float, str]] = []
    for a in agents:
        for e in a.events:
            if e.get("kind") != "excluded":
                continue
            last = str(e.get("reason") or "").split("; the last: ", 1)
            tail = f" (the last: {last[1]})" if len(last) == 2 else ""
            node = e.get("node") or a.instance_id
            out.append(
                (
                    e.get("t", 0),
                    f"node {node} excluded after {e.get('failures')} failures that began on it{tail}",
                )
            )
    return [line for _, line in sorted(out)]


def etcd_alarm(agents: list[AgentStatus]) -> str | None:
    """etcd's NOSPACE alarm as the agents saw it: the line of the newest ``rdzv_no_space`` of an
    agent whose newest of ``rdzv_no_space``/``rdzv_space_ok`` is that one; None when none is."""
    said: list[tuple[float, str]] = []
    for a in agents:
        last = next(
            (e for e in reversed(a.events) if e.get("kind") in ("rdzv_no_space", "rdzv_space_ok")), None
        )
        if last is not None and last.get("kind") == "rdzv_no_space":
            said.append((last.get("t", 0), str(last.get("detail") or "etcd is out of space")))
    return max(said)[1] if said else None


def in_service(group: dict[str, Any]) -> int:
    """Running capacity: instances in service (a warm pool's ``Warmed:*`` ones are not)."""
    return sum(1 for i in group.get("Instances", []) if i.get("LifecycleState") == "InService")


def overall_state(
    stack_status: str | None,
    agents: list[dict[str, Any]],
    desired: int | None,
    boot_failure: bool = False,
) -> str:
    """The job's state from its stack, its agents' reports and its boot logs (contracts.md)."""
    if stack_status is None:
        return "GONE"
    if stack_status.startswith("DELETE"):
        return "DELETING"
    if stack_status.endswith("_FAILED") or stack_status in ("ROLLBACK_COMPLETE", "ROLLBACK_IN_PROGRESS"):
        return "FAILED"
    if stack_status.endswith("_IN_PROGRESS") and stack_status.startswith("CREATE"):
        return "STARTING"
    if boot_failure:
        return "FAILED"
    states = [a.get("state") for a in agents]
    if "FAILED" in states:
        return "FAILED"
    if "SUCCEEDED" in states and not any(s in ("RUNNING", "RENDEZVOUS", "STARTING") for s in states):
        return "SUCCEEDED"
    if "RENDEZVOUS" in states:
        return "RENDEZVOUS"
    if "RUNNING" in states:
        return "RUNNING"
    if desired == 0:
        return "STOPPED"
    return "STARTING"


def current_agents(agents: list[dict[str, Any]], live: set[Any], now: float) -> list[dict[str, Any]]:
    """Reports that still speak for the job: live instances, final results of gone ones, and
    nodes still draining after their group let go of them.

    A hard-killed instance leaves its last report (say RUNNING) behind; it must not count.
    """

    def speaks(a: dict[str, Any]) -> bool:
        if a.get("instance_id") in live or a.get("state") in ("SUCCEEDED", "FAILED"):
            return True
        return a.get("state") == "DRAINING" and now - float(a.get("updated_at") or 0) < DRAINING_GRACE_S

    return [a for a in agents if speaks(a)]


def ever_trained(agents: list[dict[str, Any]]) -> bool:
    """Whether any agent of the job ever had its workers running (or finished)."""
    for a in agents:
        if a.get("state") in ("RUNNING", "SUCCEEDED", "DRAINING", "LEFT"):
            return True
        if any(e.get("kind") in ("workers_started", "succeeded") for e in a.get("events", []) or []):
            return True
    return False


def boot_failed(boot: BootFailures, trained: bool, desired: int | None) -> bool:
    """Every node keeps failing its boot: boot logs exist, no agent ever trained, and there are
    BOOT_FAILURES_TO_FAIL of them (or the boot scripts already scaled the groups to zero)."""
    return boot.count > 0 and not trained and (boot.count >= BOOT_FAILURES_TO_FAIL or desired == 0)


def failure_reason(f: Facts, state: str, failed_boot: bool, current: list[dict[str, Any]]) -> str | None:
    """Why a FAILED job failed, in one line; never empty for a FAILED job."""
    from petctl.ui import cmd

    if state != "FAILED":
        return None
    stack_status = f.stack.get("StackStatus") or ""
    if stack_status.endswith("_FAILED") or stack_status.startswith("ROLLBACK"):
        why = (f.stack.get("StackStatusReason") or "").strip() or "CloudFormation gave no reason"
        return f"stack {f.stack.get('StackName', '?')} is {stack_status}: {why}"
    if failed_boot:
        return boot_failure_reason(f.boot, f.job)
    stop = stopped_line(f.boot)
    if stop is not None:  # the node-failure cap stopped it (docs/contracts.md, "Boot failures")
        return f"{stop} (whole record: `{cmd(f'logs {f.job} --boot {f.boot.instance_id}')}`)"
    return agent_failure_reason(current, f.job) or (
        f"no reason was recorded; `{cmd(f'status {f.job}')}` lists the hosts and "
        f"`{cmd(f'logs {f.job}')}` prints the agents' logs"
    )


def uptime(stack: dict[str, Any], agents: list[dict[str, Any]], now: float) -> float | None:
    """Seconds since the job's stack was created (else since its first agent event)."""
    created = stack.get("CreationTime")
    if hasattr(created, "timestamp"):
        return round(now - created.timestamp(), 1)
    starts = [e.get("t") for a in agents for e in a.get("events", []) or [] if e.get("t")]
    return round(now - min(starts), 1) if starts else None


LOST_CAUSES = ("rejected", "throttled", "failed", "queue_full")


def lost_lines(agents: list[AgentStatus]) -> dict[str, int]:
    """Worker lines not stored in CloudWatch Logs, by cause, summed over the agents' reports."""
    total = dict.fromkeys(LOST_CAUSES, 0)
    for a in agents:
        for k, v in (a.get("log_events_lost") or {}).items():
            if k in total and isinstance(v, int):
                total[k] += v
    return total
