"""CloudFormation: deploy, wait with visible progress, outputs, delete, failure reasons."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from petctl import naming
from petctl.errors import AwsError, StackError, StackWaitTimeout, describe_client_error
from petctl.gateway.session import ClientError
from petctl.templates.rendering import TEMPLATE_BODY_MAX_BYTES, TEMPLATE_URL_MAX_BYTES
from petctl.ui import UI

IN_PROGRESS = "_IN_PROGRESS"
GOOD = {"CREATE_COMPLETE", "UPDATE_COMPLETE", "IMPORT_COMPLETE"}
# States that hold nothing useful and block a re-create: safe to delete first.
DEAD_ON_ARRIVAL = {"ROLLBACK_COMPLETE", "ROLLBACK_FAILED", "CREATE_FAILED"}
BROKEN = {"UPDATE_ROLLBACK_FAILED", "DELETE_FAILED", "IMPORT_ROLLBACK_FAILED"}
FAILED_EVENT = ("_FAILED",)


@dataclass
class DeployResult:
    stack_name: str
    action: str  # created | updated | unchanged
    status: str
    outputs: dict[str, str] = field(default_factory=dict)


class Stacks:
    """CloudFormation operations with bounded, visible waits.

    ``sleep`` and ``clock`` are injected so tests can drive waits without time passing.
    """

    def __init__(
        self,
        cf: Any,
        ui: UI,
        poll: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cf = cf
        self.ui = ui
        self.poll = poll
        self.sleep = sleep
        self.clock = clock

    # -- reading -----------------------------------------------------------
    def describe(self, name: str) -> dict[str, Any] | None:
        try:
            return self.cf.describe_stacks(StackName=name)["Stacks"][0]
        except ClientError as e:
            if "does not exist" in describe_client_error(e):
                return None
            raise AwsError(f"cannot describe stack {name} ({describe_client_error(e)})") from e

    def outputs(self, name: str) -> dict[str, str]:
        stack = self.describe(name)
        return outputs_of(stack) if stack else {}

    def list_stacks(self, prefix: str) -> list[dict[str, Any]]:
        """Live stacks (not deleted) whose name starts with ``prefix``."""
        result = []
        paginator = self.cf.get_paginator("describe_stacks")
        try:
            for page in paginator.paginate():
                for s in page["Stacks"]:
                    if s["StackName"].startswith(prefix) and s["StackStatus"] != "DELETE_COMPLETE":
                        result.append(s)
        except ClientError as e:
            raise AwsError(f"cannot list stacks ({describe_client_error(e)})") from e
        return result

    def job_stacks(self, profile: str) -> list[dict[str, Any]]:
        """Live job stacks of ``profile`` (job stacks are named per account and region, not per
        profile: the ``petctl:profile`` tag tells whose they are)."""
        return [
            s for s in self.list_stacks(naming.job_stack("")) if tags_of(s).get("petctl:profile") == profile
        ]

    def resource_ids(self, name: str) -> set[str]:
        """Logical ids of the resources of stack ``name`` (of its top-level template)."""
        ids: set[str] = set()
        try:
            for page in self.cf.get_paginator("list_stack_resources").paginate(StackName=name):
                ids.update(r["LogicalResourceId"] for r in page["StackResourceSummaries"])
        except ClientError as e:
            raise AwsError(f"cannot list the resources of stack {name} ({describe_client_error(e)})") from e
        return ids

    def failure_reasons(self, name: str, since: Any = None) -> list[str]:
        """``LogicalId (Type): reason`` for every failed resource event, oldest first."""
        reasons = []
        for ev in self._events(name, since):
            if since is not None and ev["Timestamp"] < since:
                continue
            if ev.get("ResourceStatus", "").endswith(FAILED_EVENT) and ev.get("ResourceStatusReason"):
                if ev.get("LogicalResourceId") == name:
                    continue
                reasons.append(
                    f"{ev['LogicalResourceId']} ({ev.get('ResourceType', '?')}): {ev['ResourceStatusReason']}"
                )
        return list(reversed(reasons))

    def _events(self, name: str, since: Any = None) -> list[dict[str, Any]]:
        """Events newest first; pages until they are older than ``since`` (big stacks have many)."""
        events: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"StackName": name}
        try:
            while True:
                page = self.cf.describe_stack_events(**kwargs)
                events.extend(page["StackEvents"])
                token = page.get("NextToken")
                if not token or (since is not None and events and events[-1]["Timestamp"] < since):
                    return events
                kwargs["NextToken"] = token
        except ClientError:
            return events

    # -- writing -----------------------------------------------------------
    def deploy(
        self,
        name: str,
        template: str,
        parameters: list[dict[str, str]],
        tags: dict[str, str],
        timeout: float = 1800,
        on_failure_delete: bool = True,
        template_url: str | None = None,
    ) -> DeployResult:
        """Create the stack, or update it in place if it exists; wait; raise StackError on failure.

        ``template_url``: the https URL of ``template`` already uploaded to S3 (same region),
        sent as ``TemplateURL`` (cap 1 MB) instead of the body inline (cap 51,200 bytes); a
        template over the cap of the way it would be sent is refused here, before any change.
        A create that fails is deleted (``on_failure_delete``), so nothing half-made is left.
        """
        _check_size(name, template, template_url)
        existing = self.describe(name)
        if existing and existing["StackStatus"] in DEAD_ON_ARRIVAL:
            self.ui.progress(
                f"stack {name} is left over from a failed create ({existing['StackStatus']}); deleting it"
            )
            self.delete(name, timeout=timeout)
            existing = None
        if existing:
            status = existing["StackStatus"]
            if status in BROKEN:
                raise StackError(
                    f"stack {name} is {status}; fix it in the CloudFormation console or delete it, then retry"
                )
            if status.endswith(IN_PROGRESS):
                raise StackError(f"stack {name} is busy ({status}); wait for it to finish, then retry")
        kwargs = {
            "StackName": name,
            **({"TemplateURL": template_url} if template_url else {"TemplateBody": template}),
            "Parameters": parameters,
            "Capabilities": ["CAPABILITY_IAM", "CAPABILITY_NAMED_IAM"],
            "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
        }
        started = self._now_utc()
        if existing is None:
            self.ui.progress(f"creating stack {name}")
            try:
                self.cf.create_stack(**kwargs)
            except BaseException as e:
                # moto raises here instead of producing CREATE_FAILED; AWS does this for bad templates.
                # A Ctrl-C during the call may still have created the stack: clean up either way.
                self._cleanup_failed_create(name, on_failure_delete, timeout)
                if isinstance(e, ClientError):
                    raise StackError(f"stack {name} could not be created: {describe_client_error(e)}") from e
                raise
            action = "created"
        else:
            self.ui.progress(f"updating stack {name}")
            try:
                self.cf.update_stack(**kwargs)
            except ClientError as e:
                if "No updates are to be performed" in str(e):
                    self.ui.progress(f"stack {name} is up to date; nothing changed")
                    return DeployResult(name, "unchanged", existing["StackStatus"], outputs_of(existing))
                raise StackError(f"stack {name} could not be updated: {describe_client_error(e)}") from e
            action = "updated"
        try:
            stack = self.wait(name, timeout=timeout, since=started)
        except KeyboardInterrupt:
            if action == "created":
                self.ui.progress(f"interrupted: deleting the half-made stack {name}")
                self._cleanup_failed_create(name, True, timeout)
            raise
        status = stack["StackStatus"]
        if status not in GOOD:
            reasons = self.failure_reasons(name, since=started)
            if action == "created":
                self._cleanup_failed_create(name, on_failure_delete, timeout)
            detail = "; ".join(reasons) if reasons else (stack.get("StackStatusReason") or "no reason given")
            raise StackError(f"stack {name} failed ({status}): {detail}")
        return DeployResult(name, action, status, outputs_of(stack))

    def _cleanup_failed_create(self, name: str, enabled: bool, timeout: float) -> None:
        if not enabled:
            return
        # Delete without describing first: deleting a missing stack is a no-op, and a half-made
        # stack may not even describe (moto answers 500 when its outputs name resources it never made).
        try:
            self.ui.progress(f"deleting the failed stack {name}")
            try:
                self.cf.delete_stack(StackName=name)
            except ClientError as e:
                self.ui.debug(f"delete_stack {name}: {describe_client_error(e)}")
            stack = self.wait(name, timeout=timeout)
            if stack["StackStatus"] != "DELETE_COMPLETE":
                raise StackError(f"it is {stack['StackStatus']}")
        except Exception as e:  # noqa: BLE001 - cleanup must not hide the original error
            self.ui.warn(
                f"could not delete the failed stack {name}: {e}; delete it in the CloudFormation console"
            )

    def start_delete(self, name: str) -> None:
        """Start deleting a stack and return at once."""
        self.cf.delete_stack(StackName=name)

    def delete(self, name: str, timeout: float = 1800) -> bool:
        """Delete a stack and wait; False if it did not exist."""
        stack = self.describe(name)
        if stack is None:
            return False
        started = self._now_utc()
        self.ui.progress(f"deleting stack {name}")
        try:
            self.cf.delete_stack(StackName=stack["StackId"])
        except ClientError as e:
            # Trust the stack's state over the call's answer: some emulators (moto) raise from
            # delete_stack after removing the stack, e.g. on a VPC whose route table they leak.
            after = self.describe(name)
            if after is not None and after["StackStatus"] != "DELETE_COMPLETE":
                raise StackError(f"stack {name} could not be deleted: {describe_client_error(e)}") from e
            self.ui.debug(f"delete_stack {name} answered {describe_client_error(e)}, but the stack is gone")
            return True
        final = self.wait(stack["StackId"], timeout=timeout, since=started, label=name)
        if final and final["StackStatus"] != "DELETE_COMPLETE":
            reasons = self.failure_reasons(stack["StackId"], since=started)
            raise StackError(
                f"stack {name} could not be deleted ({final['StackStatus']}): {'; '.join(reasons) or 'no reason'}"
            )
        return True

    def wait(self, name: str, timeout: float, since: Any = None, label: str | None = None) -> dict[str, Any]:
        """Poll until the stack leaves ``*_IN_PROGRESS``, printing resource events as they happen."""
        label = label or name
        deadline = self.clock() + timeout
        seen: set[str] = set()
        while True:
            for ev in reversed(self._events(name, since)):
                if ev["EventId"] in seen or (since is not None and ev["Timestamp"] < since):
                    continue
                seen.add(ev["EventId"])
                reason = f" - {ev['ResourceStatusReason']}" if ev.get("ResourceStatusReason") else ""
                self.ui.progress(
                    f"  {ev.get('ResourceStatus', '?'):<20} {ev.get('ResourceType', '?'):<40} "
                    f"{ev.get('LogicalResourceId', '?')}{reason}"
                )
            stack = self.describe(name)
            if stack is None:
                return {"StackName": label, "StackStatus": "DELETE_COMPLETE"}
            if not stack["StackStatus"].endswith(IN_PROGRESS):
                return stack
            waited = self.clock() - (deadline - timeout)
            self.ui.live(f"{label}: {stack['StackStatus']} ({waited:.0f}s of at most {timeout:.0f}s)")
            if self.clock() >= deadline:
                raise StackWaitTimeout(
                    f"gave up waiting for stack {label} after {timeout:.0f}s (still {stack['StackStatus']}); "
                    f"check the CloudFormation console"
                )
            self.sleep(self.poll)

    @staticmethod
    def _now_utc() -> Any:
        import datetime as _dt

        # A little slack: CloudFormation event clocks and ours differ slightly.
        return _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(seconds=5)


def _check_size(name: str, template: str, template_url: str | None) -> None:
    size = len(template.encode("utf-8"))
    cap = TEMPLATE_URL_MAX_BYTES if template_url else TEMPLATE_BODY_MAX_BYTES
    if size > cap:
        how = "from S3 (TemplateURL)" if template_url else "inline (TemplateBody)"
        raise StackError(
            f"the template of stack {name} is {size} bytes, over CloudFormation's cap of {cap} bytes "
            f"for a template sent {how}; this is a petctl bug: report it with the command you ran"
        )


def outputs_of(stack: dict[str, Any]) -> dict[str, str]:
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", []) or []}


def parameters_of(stack: dict[str, Any]) -> dict[str, str | None]:
    return {p["ParameterKey"]: p.get("ParameterValue") for p in stack.get("Parameters", []) or []}


def tags_of(stack: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in stack.get("Tags", []) or []}
