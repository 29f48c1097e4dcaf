"""The reconciler's pure diff (petctl/local/plan.py): moto's state and the local records in,
actions out. No process, no AWS."""

from __future__ import annotations

from petctl.local import plan
from petctl.local.plan import Local, Observed, Seen

GROUP = {"aws:autoscaling:groupName": "g", "petctl:role": "worker"}


def seen(
    iid: str, state: str = "running", tags: dict[str, str] | None = None, lifecycle: str | None = None
) -> Seen:
    return Seen(iid, state, GROUP if tags is None else tags, {"InstanceId": iid}, lifecycle)


def diff(instances: list[Seen], local: dict[str, Local] | None = None, **kw: object) -> list[plan.Action]:
    return plan.diff(Observed({s.instance_id: s for s in instances}, **kw), local or {})  # type: ignore[arg-type]


def test_new_live_instances_boot_and_stopped_unknown_ones_do_not() -> None:
    a, b = seen("i-a"), seen("i-b", "pending")
    assert diff([a, b, seen("i-c", "stopped")]) == [plan.Boot(a), plan.Boot(b)]


def test_a_warm_pool_instance_boots_into_its_pool() -> None:
    s = seen("i-w", lifecycle="Warmed:Pending")
    assert diff([s]) == [plan.Boot(s, warm=True)]


def test_known_instance_in_step_needs_nothing() -> None:
    assert diff([seen("i-a")], {"i-a": Local("running", GROUP, boot_rc=0, has_main=True)}) == []


def test_tags_changed() -> None:
    tags = {**GROUP, "x": "1"}
    assert diff([seen("i-a", tags=tags)], {"i-a": Local("running", GROUP, has_main=True)}) == [
        plan.UpdateTags("i-a", tags)
    ]


def test_exits_are_recorded_once_and_only_while_running() -> None:
    booting = Local("running", GROUP, boot_exit=0)
    assert diff([seen("i-a")], {"i-a": booting}) == [
        plan.BootEnded("i-a", 0),
        plan.BootWithoutService("i-a", 0),
    ]
    failed = Local("running", GROUP, boot_rc=None, boot_exit=2, has_main=True)
    assert diff([seen("i-a")], {"i-a": failed}) == [plan.BootEnded("i-a", 2)]
    crashed = Local("running", GROUP, boot_rc=0, boot_exit=0, has_main=True, main_exit=3)
    assert diff([seen("i-a")], {"i-a": crashed}) == [plan.MainExited("i-a", 3)]
    exited = Local("exited", GROUP, boot_rc=0, boot_exit=0, has_main=True, main_exit=3)
    assert diff([seen("i-a")], {"i-a": exited}) == []


def test_instances_that_left_are_drained() -> None:
    local = {
        "i-term": Local("running", GROUP),
        "i-gone": Local("exited", GROUP),
        "i-done": Local("terminated", GROUP),
        "i-drain": Local("draining", GROUP),
    }
    assert diff([seen("i-term", "shutting-down")], local) == [
        plan.Leave("i-term", "instance is shutting-down"),
        plan.Leave("i-gone", "instance is no longer running"),
    ]


def test_orphans_of_a_deleted_group_are_terminated_when_groups_are_read() -> None:
    a = seen("i-a")
    assert diff([a], {"i-a": Local("running", GROUP, has_main=True)}, groups={}) == [
        plan.TerminateOrphans(("i-a",))
    ]
    assert diff([a], {"i-a": Local("running", GROUP, has_main=True)}) == []  # groups not read this tick


def test_unhealthy_in_service_instances_are_replaced_once() -> None:
    groups = {
        "g": {
            "Instances": [
                {"InstanceId": "i-a", "HealthStatus": "Unhealthy", "LifecycleState": "InService"},
                {"InstanceId": "i-b", "HealthStatus": "Unhealthy", "LifecycleState": "InService"},
                {"InstanceId": "i-c", "HealthStatus": "Healthy", "LifecycleState": "InService"},
            ]
        }
    }
    local = {
        "i-a": Local("running", GROUP, has_main=True),
        "i-b": Local("running", GROUP, has_main=True, replaced=True),
        "i-c": Local("running", GROUP, has_main=True),
    }
    assert diff([seen("i-a"), seen("i-b"), seen("i-c")], local, groups=groups) == [
        plan.ReplaceUnhealthy("i-a", "g")
    ]


def test_warm_pool_instance_is_stopped_once_its_agent_reports_warmed() -> None:
    pending = Local("running", GROUP, has_main=True, warm="Warmed:Pending")
    s = seen("i-w", lifecycle="Warmed:Pending")
    assert diff([s], {"i-w": pending}) == []  # still booting
    assert diff([s], {"i-w": pending}, warmed=frozenset({"i-w"})) == [plan.Warmed("i-w")]


def test_a_stopped_pool_instance_is_parked_not_leaving_and_resumes_when_taken() -> None:
    parked = Local("running", GROUP, has_main=True, warm="Warmed:Stopped")
    assert diff([seen("i-w", "stopped", lifecycle="Warmed:Stopped")], {"i-w": parked}) == []
    assert diff([seen("i-w", "running", lifecycle="InService")], {"i-w": parked}) == [plan.Resume("i-w")]
    # Taken while still booting: resumed (nothing paused yet) rather than stopped.
    pending = Local("running", GROUP, has_main=True, warm="Warmed:Pending")
    assert diff([seen("i-w", lifecycle="InService")], {"i-w": pending}, warmed=frozenset({"i-w"})) == [
        plan.Resume("i-w")
    ]
    # A stopped instance that is not in a pool left (the local cloud does not model EC2 stop/start).
    plain = Local("running", GROUP, has_main=True)
    assert diff([seen("i-a", "stopped")], {"i-a": plain}) == [plan.Leave("i-a", "instance is stopped")]
    # Terminated in its pool: it leaves.
    assert diff([], {"i-w": parked}) == [plan.Leave("i-w", "instance is no longer running")]
