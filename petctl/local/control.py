"""The daemon's control API: what ``petctl local …`` asks of a running local cloud.

Served on the IMDS server's port under ``/_control/…`` (the IMDS server routes there and
checks the ``X-Petctl-Control-Token`` header against :attr:`ControlApi.token`, which only
``cloud.json``, readable by the user alone, holds)::

    GET  /_control/status
    POST /_control/kill-instance/<instance-id>
    POST /_control/spot-interrupt/<instance-id>?seconds=120
    POST /_control/restart-rdzv/<job>

Answers are JSON; a ``LookupError`` from the reconciler becomes 404, a ``ValueError`` 409.
"""

from __future__ import annotations

import secrets
from typing import Any, Protocol


class _Faults(Protocol):
    def kill_instance(self, instance_id: str) -> dict[str, Any]: ...

    def spot_interrupt(self, instance_id: str, seconds: float) -> dict[str, Any]: ...

    def restart_rdzv(self, job: str) -> dict[str, Any]: ...


class _Cloud(Protocol):
    reconciler: Any  # a _Faults once started

    def status(self) -> dict[str, Any]: ...


class ControlApi:
    """Routes one control request to the cloud; holds the token that guards it."""

    def __init__(self, cloud: _Cloud) -> None:
        self.cloud = cloud
        self.token = secrets.token_hex(16)

    def handle(self, method: str, path: str, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) for ``method path`` (``path`` starts with ``/_control/``)."""
        parts = path.strip("/").split("/")[1:]  # drop "_control"
        faults: _Faults = self.cloud.reconciler
        try:
            if method == "GET" and parts == ["status"]:
                return 200, self.cloud.status()
            if method == "POST" and len(parts) == 2 and parts[0] == "kill-instance":
                return 200, faults.kill_instance(parts[1])
            if method == "POST" and len(parts) == 2 and parts[0] == "spot-interrupt":
                seconds = float(query.get("seconds", ["120"])[0])
                if not 0 <= seconds <= 3600:
                    raise ValueError(f"seconds={seconds} is out of range: use 0 to 3600")
                return 200, faults.spot_interrupt(parts[1], seconds)
            if method == "POST" and len(parts) == 2 and parts[0] == "restart-rdzv":
                return 200, faults.restart_rdzv(parts[1])
        except LookupError as e:
            return 404, {"error": str(e.args[0] if e.args else e)}
        except ValueError as e:
            return 409, {"error": str(e)}
        return 404, {"error": f"unknown control request {method} {path}"}
