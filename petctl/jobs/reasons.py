"""Why a job failed, in one line: the line of a log that says what went wrong, and the reason of
a failed boot, of the node-failure cap, or of the agent that failed first.

Pure, as :mod:`petctl.jobs.state` (which picks among them for a FAILED job): no AWS call, no
clock read. :data:`ERROR_LINE` is shared with the boot scripts (a test checks they agree).
"""

from __future__ import annotations

import re
from typing import Any

from petctl.jobs.status import BootFailures

#: A line that says what went wrong: a Python exception (a traceback's last line), ``error:``,
#: ``ERROR``, ``FAILED``, bash's own complaints. The boot scripts' ERR trap finds the same line
#: with the same pattern (``first_error`` in cfn_templates/user_data/common.sh.j2).
ERROR_LINE = re.compile(
    "^[A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Exit|Interrupt)[A-Za-z0-9_.]*:|[Ee]rror:|ERROR|FAILED"
    "|[Ff]atal:|command not found|unbound variable|syntax error|[Pp]ermission denied|No such file"
    "|[Tt]imed out|Connection refused"
)
#: The boot scripts' own closing line (``petctl boot: FAILED (exit N) at line L: ...``): a line of
#: last resort, the cause is above it.
_BOOT_TRAILER = "petctl boot: FAILED (exit"
#: How long a reason's quoted line may be.
REASON_LINE_MAX = 300


def first_error_line(lines: list[str]) -> str | None:
    """The first line that says what went wrong, not the first line of the log (indented lines, a
    traceback's frames and code, and the boot scripts' closing line do not count); else the last
    line above the closing one."""
    picked = next(
        (
            line
            for line in lines
            if line[:1] not in (" ", "\t") and not line.startswith(_BOOT_TRAILER) and ERROR_LINE.search(line)
        ),
        None,
    ) or next(  # else the last line above the closing one
        (line for line in reversed(lines) if line.strip() and not line.startswith(_BOOT_TRAILER)), None
    )
    if picked is None:
        return None
    picked = picked.strip()
    return picked if len(picked) <= REASON_LINE_MAX else picked[: REASON_LINE_MAX - 3] + "..."


#: How the newest failure record says that the node-failure cap stopped the job (the agent's
#: ``node/failure.py`` and the boot scripts' give-up write it)
_STOPPED = re.compile(r"stopping the job: .*")


def stopped_line(boot: BootFailures) -> str | None:
    """The newest failure record's "stopping the job: ..." (the node-failure cap), or None."""
    for line in boot.last_lines:
        m = _STOPPED.search(line)
        if m:
            text = "the job stopped itself: " + m.group(0)[len("stopping the job: ") :]
            return text if len(text) <= REASON_LINE_MAX else text[: REASON_LINE_MAX - 3] + "..."
    return None


def boot_failure_reason(boot: BootFailures, job: str) -> str:
    """One line: how many boots failed, the newest one's instance and first error line, and the
    command that prints its whole log."""
    from petctl.ui import cmd

    error = boot.error or first_error_line(boot.last_lines) or "its log is empty"
    return (
        f"{boot.count} instance boot(s) failed and no node ever trained; {boot.instance_id}: {error} "
        f"(whole boot log: `{cmd(f'logs {job} --boot {boot.instance_id}')}`)"
    )


def _failed_event(a: dict[str, Any]) -> dict[str, Any]:
    """The agent's last ``failed`` event ({} when it has none)."""
    return next((e for e in reversed(a.get("events") or []) if e.get("kind") == "failed"), {})


def agent_failure_reason(agents: list[dict[str, Any]], job: str) -> str | None:
    """The reason of the agent that failed first on its own, with its instance and the command
    that prints its log. An agent that failed because another one closed the rendezvous (its
    ``failed`` event says ``closed``) comes after every agent that failed for a reason of its own;
    then the earliest ``failed`` event (else the earliest report) comes first."""
    from petctl.ui import cmd

    def order(a: dict[str, Any]) -> tuple[bool, float]:
        ev = _failed_event(a)
        return bool(ev.get("closed")), float(ev.get("t") or a.get("updated_at") or 0)

    failed = sorted((a for a in agents if a.get("state") == "FAILED"), key=order)
    if not failed:
        return None
    a = failed[0]
    iid = a.get("instance_id") or "?"
    why = (a.get("reason") or "").strip().splitlines()
    text = (first_error_line(why) or why[-1]) if why else "its agent published no reason"
    return f"the agent of {iid} FAILED: {text} (its log: `{cmd(f'logs {job} --instance {iid}')}`)"
