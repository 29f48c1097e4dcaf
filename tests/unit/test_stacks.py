"""Stack waits and failure handling that moto cannot produce (it never emits CREATE_FAILED),
driven through botocore's Stubber on a real CloudFormation client."""

from __future__ import annotations

import datetime as dt

import boto3
import pytest
from botocore.stub import ANY, Stubber

from petctl.errors import StackError
from petctl.gateway.stacks import Stacks
from petctl.ui import UI

NOW = dt.datetime.now(dt.timezone.utc)


def stack(status: str, outputs=None) -> dict:
    s = {
        "StackName": "s",
        "StackId": "arn:aws:cloudformation:us-east-1:123456789012:stack/s/1",
        "StackStatus": status,
        "CreationTime": NOW,
    }
    if outputs:
        s["Outputs"] = [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()]
    return s


def event(
    eid: str, logical: str, status: str, reason: str | None = None, rtype: str = "AWS::EFS::FileSystem"
) -> dict:
    e = {
        "StackId": "x",
        "EventId": eid,
        "StackName": "s",
        "LogicalResourceId": logical,
        "ResourceType": rtype,
        "ResourceStatus": status,
        "Timestamp": dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=int(eid[1:])),
    }
    if reason:
        e["ResourceStatusReason"] = reason
    return e


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def make(cf, clock=None):
    clock = clock or FakeClock()
    return Stacks(cf, UI(quiet=True), poll=5, sleep=clock.sleep, clock=clock)


def not_found(stubber):
    stubber.add_client_error("describe_stacks", "ValidationError", "Stack with id s does not exist")


@pytest.fixture
def cf():
    client = boto3.client("cloudformation", region_name="us-east-1", endpoint_url="http://127.0.0.1:9")
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def test_create_failed_reports_resources_and_deletes_the_stack(cf):
    client, st = cf
    not_found(st)
    st.add_response(
        "create_stack",
        {"StackId": "arn:1"},
        {"StackName": "s", "TemplateBody": ANY, "Parameters": ANY, "Capabilities": ANY, "Tags": ANY},
    )
    st.add_response("describe_stack_events", {"StackEvents": [event("e1", "Efs", "CREATE_IN_PROGRESS")]})
    st.add_response("describe_stacks", {"Stacks": [stack("CREATE_IN_PROGRESS")]})
    failed = [
        event(
            "e3",
            "s",
            "ROLLBACK_IN_PROGRESS",
            "The following resource(s) failed to create: [Efs]",
            "AWS::CloudFormation::Stack",
        ),
        event("e2", "Efs", "CREATE_FAILED", 'Resource handler returned message: "quota exceeded"'),
        event("e1", "Efs", "CREATE_IN_PROGRESS"),
    ]
    st.add_response("describe_stack_events", {"StackEvents": failed})
    st.add_response("describe_stacks", {"Stacks": [stack("ROLLBACK_COMPLETE")]})
    st.add_response("describe_stack_events", {"StackEvents": failed})  # failure_reasons
    # cleanup: delete -> wait until gone
    st.add_response("delete_stack", {}, {"StackName": "s"})
    st.add_response("describe_stack_events", {"StackEvents": []})
    st.add_response("describe_stacks", {"Stacks": [stack("DELETE_COMPLETE")]})
    with pytest.raises(StackError) as e:
        make(client).deploy("s", "{}", [], {"petctl:profile": "p"})
    msg = str(e.value)
    assert "stack s failed (ROLLBACK_COMPLETE)" in msg
    assert "Efs (AWS::EFS::FileSystem)" in msg and "quota exceeded" in msg


def test_wait_is_bounded(cf):
    client, st = cf
    clock = FakeClock()
    for _ in range(4):
        st.add_response("describe_stack_events", {"StackEvents": []})
        st.add_response("describe_stacks", {"Stacks": [stack("CREATE_IN_PROGRESS")]})
    with pytest.raises(StackError, match="gave up waiting for stack s after 15s"):
        make(client, clock).wait("s", timeout=15)
    assert clock.t == 15


def test_update_with_no_changes_says_so(cf):
    client, st = cf
    st.add_response("describe_stacks", {"Stacks": [stack("CREATE_COMPLETE", {"VpcId": "vpc-1"})]})
    st.add_client_error("update_stack", "ValidationError", "No updates are to be performed.")
    r = make(client).deploy("s", "{}", [], {})
    assert r.action == "unchanged" and r.outputs == {"VpcId": "vpc-1"}


@pytest.mark.parametrize("status", ["UPDATE_ROLLBACK_FAILED", "DELETE_FAILED"])
def test_broken_stack_is_a_clear_error(cf, status):
    client, st = cf
    st.add_response("describe_stacks", {"Stacks": [stack(status)]})
    with pytest.raises(StackError, match=f"stack s is {status}; fix it"):
        make(client).deploy("s", "{}", [], {})


def test_busy_stack_is_a_clear_error(cf):
    client, st = cf
    st.add_response("describe_stacks", {"Stacks": [stack("UPDATE_IN_PROGRESS")]})
    with pytest.raises(StackError, match="is busy"):
        make(client).deploy("s", "{}", [], {})


def test_long_waits_redraw_a_live_line_on_a_terminal_only(monkeypatch, capsys):
    """A terminal sees one line redrawn with the elapsed time; a pipe sees only progress lines."""
    from petctl.ui import UI

    class Cf:
        polls = 0

        def describe_stacks(self, StackName):
            self.polls += 1
            status = "CREATE_COMPLETE" if self.polls > 3 else "CREATE_IN_PROGRESS"
            return {"Stacks": [{"StackName": StackName, "StackStatus": status}]}

        def describe_stack_events(self, StackName, **kw):
            return {"StackEvents": []}

    for tty in (True, False):
        ui = UI()
        monkeypatch.setattr(UI, "live_enabled", property(lambda self, t=tty: t))
        clock = iter(range(0, 1000, 5))
        Stacks(Cf(), ui, poll=0, sleep=lambda s: None, clock=lambda c=clock: next(c)).wait("s", timeout=600)
        err = capsys.readouterr().err
        if tty:
            assert "\r" in err and "s: CREATE_IN_PROGRESS (" in err and "of at most 600s)" in err
        else:
            assert "\r" not in err and "CREATE_IN_PROGRESS" not in err
