"""The reconciler's decision, pure: from what moto says (desired) and what runs here (actual) to
a list of actions. No process, no clock, no AWS call: :func:`diff` is plain data in, plain data
out, and :class:`petctl.local.reconciler.Reconciler` carries the actions out.

The rules, per EC2 instance tagged ``petctl:role``:

* ``pending``/``running`` in moto, not known here → :class:`Boot` (into its warm pool when Auto
  Scaling says ``Warmed:*``);
* its Auto Scaling group is gone → :class:`TerminateOrphans` (AWS terminates them);
* known and booting: its boot script ended → :class:`BootEnded`; its main unit exited →
  :class:`MainExited`; the boot ended without starting a unit → :class:`BootWithoutService`;
* in a warm pool, ``Warmed:Pending``, and its agent reports ``WARMED`` → :class:`Warmed` (AWS stops
  it: the local cloud pauses its tree); moved into its group (lifecycle no longer ``Warmed:*``) →
  :class:`Resume`;
* no longer running in moto (terminated, or gone from the answer) → :class:`Leave`, except a warm
  pool instance that moto shows stopped (it is parked, not leaving);
* ``Unhealthy`` in its group while ``InService`` → :class:`ReplaceUnhealthy` (the group's health
  check, which moto does not run).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

LIVE_STATES = ("pending", "running")
PARKED_STATES = ("stopping", "stopped")
#: Instances that have processes here and are not leaving.
ACTIVE = ("running", "exited", "restarting")
ASG_TAG = "aws:autoscaling:groupName"
ROLE_TAG, JOB_TAG, SPEC_TAG, RDZV_TAG = "petctl:role", "petctl:job", "petctl:spec", "petctl:rdzv"
WARMED = "Warmed:"


# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Seen:
    """One EC2 instance as moto describes it."""

    instance_id: str
    state: str
    tags: Mapping[str, str]
    data: Mapping[str, Any] = field(default_factory=dict, compare=False)  # DescribeInstances' item
    lifecycle: str | None = None  # its Auto Scaling lifecycle state, when asked (new or warm ones)

    @property
    def group(self) -> str | None:
        return self.tags.get(ASG_TAG)


@dataclass(frozen=True)
class Observed:
    """Desired state: moto's answer for one tick."""

    instances: Mapping[str, Seen]
    groups: Mapping[str, Mapping[str, Any]] | None = None  # None: not read this tick
    warmed: frozenset[str] = frozenset()  # pool instances whose agent reports WARMED


@dataclass(frozen=True)
class Local:
    """Actual state: one known instance, as its record and its processes stand now."""

    state: str
    tags: Mapping[str, str] = field(default_factory=dict)
    has_boot: bool = True
    boot_rc: int | None = None  # recorded exit status of the boot script
    boot_exit: int | None = None  # the boot script's exit status polled now (None: running)
    main_exit: int | None = None  # the main unit's exit status polled now (None: running or none)
    has_main: bool = False
    warm: str | None = None  # Warmed:Pending / Warmed:Stopped while in its pool
    replaced: bool = False  # Unhealthy: already terminated in its group


# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Boot:
    """Run the instance's user data (into its warm pool when ``warm``)."""

    seen: Seen
    warm: bool = False


@dataclass(frozen=True)
class UpdateTags:
    """Its tags changed in moto."""

    instance_id: str
    tags: Mapping[str, str]


@dataclass(frozen=True)
class _OnInstance:
    instance_id: str


@dataclass(frozen=True)
class _Exited(_OnInstance):
    rc: int


class BootEnded(_Exited):
    """Its boot script exited with ``rc``: record it."""


class MainExited(_Exited):
    """Its main unit's process exited with ``rc``: restarted as the unit's ``Restart=`` says, else
    the instance is ``exited``."""


class BootWithoutService(_Exited):
    """Its boot ended (``rc``) without starting a unit: ``exited``, with a note."""


class Warmed(_OnInstance):
    """Booted in its warm pool: the pool stops it, its tree is paused."""


class Resume(_OnInstance):
    """A scale-out took it from its pool: InService, its tree continues."""


@dataclass(frozen=True)
class Leave(_OnInstance):
    """It left moto (terminated, gone): drain it, then end its tree."""

    why: str


@dataclass(frozen=True)
class TerminateOrphans:
    """Their group is gone: terminate them in EC2, as AWS does."""

    instance_ids: tuple[str, ...]


@dataclass(frozen=True)
class ReplaceUnhealthy(_OnInstance):
    """Unhealthy in ``group``: terminate it there without decrement, so the group replaces it."""

    group: str


Action = (
    Boot
    | UpdateTags
    | BootEnded
    | MainExited
    | BootWithoutService
    | Warmed
    | Resume
    | Leave
    | TerminateOrphans
    | ReplaceUnhealthy
)


# ---------------------------------------------------------------------------- the diff


def diff(observed: Observed, local: Mapping[str, Local]) -> list[Action]:
    """What to do so that the local processes match ``observed``."""
    return list(_diff(observed, local))


def _diff(observed: Observed, local: Mapping[str, Local]) -> Iterator[Action]:
    groups = observed.groups
    orphans = []
    for iid, seen in observed.instances.items():
        rec = local.get(iid)
        if seen.state in LIVE_STATES:
            if groups is not None and seen.group and seen.group not in groups:
                orphans.append(iid)  # its group was deleted: AWS terminates its instances
                continue
            if rec is None:
                yield Boot(seen, warm=bool(seen.lifecycle and seen.lifecycle.startswith(WARMED)))
                continue
            if dict(seen.tags) != dict(rec.tags):
                yield UpdateTags(iid, seen.tags)
            yield from _exits(iid, rec)
            if rec.warm and seen.lifecycle and not seen.lifecycle.startswith(WARMED):
                yield Resume(iid)
            elif rec.warm == WARMED + "Pending" and rec.state == "running" and iid in observed.warmed:
                yield Warmed(iid)
        elif rec is not None and rec.state in ACTIVE:
            if rec.warm and seen.state in PARKED_STATES:
                continue  # stopped in its warm pool
            yield Leave(iid, f"instance is {seen.state}")
    for iid, rec in local.items():
        if iid not in observed.instances and rec.state in ACTIVE:
            yield Leave(iid, "instance is no longer running")
    if orphans:
        yield TerminateOrphans(tuple(orphans))
    for name, group in (groups or {}).items():
        for gi in group.get("Instances", []):
            rec = local.get(gi["InstanceId"])
            if (
                gi.get("HealthStatus") == "Unhealthy"
                and gi.get("LifecycleState") == "InService"
                and rec is not None
                and not rec.replaced
            ):
                yield ReplaceUnhealthy(gi["InstanceId"], name)


def _exits(iid: str, rec: Local) -> Iterator[Action]:
    """A booting/booted instance's processes that ended since the last tick."""
    if rec.state != "running":
        return
    boot_rc = rec.boot_rc
    if rec.has_boot and boot_rc is None and rec.boot_exit is not None:
        boot_rc = rec.boot_exit
        yield BootEnded(iid, boot_rc)
    if rec.has_main:
        if rec.main_exit is not None:
            yield MainExited(iid, rec.main_exit)
    elif boot_rc is not None:
        yield BootWithoutService(iid, boot_rc)
