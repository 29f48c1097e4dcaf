"""CloudWatch Logs: the job's streams ``<job>/<instance-id>``."""

from __future__ import annotations

from typing import Any

from petctl.errors import PetctlError, describe_client_error
from petctl.ui import cmd


class Logs:
    def __init__(self, logs: Any) -> None:
        self.logs = logs

    def has_streams(self, group: str, prefix: str) -> bool:
        """Did any stream named ``prefix...`` ever get written? (A missing group has none.)"""
        try:
            streams = self.logs.describe_log_streams(logGroupName=group, logStreamNamePrefix=prefix, limit=1)
        except Exception as e:  # noqa: BLE001
            if describe_client_error(e).startswith("ResourceNotFoundException"):
                return False
            raise
        return bool(streams.get("logStreams"))

    def events(self, group: str, prefix: str, start_ms: int) -> list[dict[str, Any]]:
        """Events of the streams named ``prefix...`` from ``start_ms`` on (unordered)."""
        kwargs = {"logGroupName": group, "logStreamNamePrefix": prefix, "startTime": start_ms}
        try:
            return [
                ev
                for page in self.logs.get_paginator("filter_log_events").paginate(**kwargs)
                for ev in page.get("events", [])
            ]
        except Exception as e:  # noqa: BLE001
            if describe_client_error(e).startswith("ResourceNotFoundException"):
                raise PetctlError(
                    f"log group {group} does not exist; was `{cmd('setup')}` run for this profile?"
                ) from e
            raise
