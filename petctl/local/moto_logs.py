"""CloudWatch Logs in moto held to AWS's request rules: stream prefixes and batch caps.

Part of :mod:`petctl.local.moto_patches` (its items 3 and 5):

* **Log stream prefix**: moto's ``FilterLogEvents`` ignores ``logStreamNamePrefix`` and returns
  every stream of the group, so ``petctl logs J`` showed other jobs' lines. It is honoured as AWS
  does (and naming both ``logStreamNames`` and the prefix is refused).
* **PutLogEvents limits**: at most 10,000 events and 1,048,576 bytes a batch (messages' UTF-8 bytes
  plus 26 per event), 256 KB an event, non-empty messages. AWS refuses the call; moto accepts
  anything. ``rejectedLogEventsInfo`` as the API reference defines it: ``tooOldLogEventEndIndex``
  exclusive (moto names the last too-old event instead) and ``expiredLogEventEndIndex`` for events
  older than the group's retention (moto has none; it still stores them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from petctl.local.patching import wrap


def _patch_log_stream_prefix() -> None:
    from moto.logs.exceptions import InvalidParameterException
    from moto.logs.responses import LogsResponse

    @wrap(LogsResponse, "filter_log_events")
    def filter_log_events(original: Callable[[Any], str], self: Any) -> str:
        prefix = self._get_param("logStreamNamePrefix")
        if not prefix:
            return original(self)
        if self._get_param("logStreamNames"):
            raise InvalidParameterException(
                "Cannot specify both logStreamNames and logStreamNamePrefix in the same request"
            )
        group_name = self._get_param("logGroupName")
        group = self.logs_backend.groups.get(group_name)
        names = sorted(n for n in (group.streams if group else {}) if n.startswith(prefix))
        if not names:  # moto reads an empty list as "every stream"
            return json.dumps({"events": [], "searchedLogStreams": []})
        events, next_token, searched = self.logs_backend.filter_log_events(
            group_name,
            names,
            self._get_param("startTime"),
            self._get_param("endTime"),
            self._get_param("limit"),
            self._get_param("nextToken"),
            self._get_param("filterPattern"),
            self._get_param("interleaved", False),
        )
        return json.dumps({"events": events, "nextToken": next_token, "searchedLogStreams": searched})


def _patch_put_log_events_limits() -> None:
    from moto.logs.exceptions import InvalidParameterException
    from moto.logs.responses import LogsResponse

    @wrap(LogsResponse, "put_log_events")
    def put_log_events(original: Callable[[Any], str], self: Any) -> str:
        events = self._get_param("logEvents") or []
        if len(events) > 10_000:
            raise InvalidParameterException(f"Too many log events in the batch: {len(events)} (max 10000)")
        sizes = [len((e.get("message") or "").encode("utf-8")) + 26 for e in events]
        if any(size > 256 * 1024 for size in sizes):
            raise InvalidParameterException("Log event too large: the maximum is 262144 bytes")
        if any(not e.get("message") for e in events):
            raise InvalidParameterException("Log event message must not be empty")
        if sum(sizes) > 1_048_576:
            raise InvalidParameterException(f"Upload too large: {sum(sizes)} bytes exceeds 1048576 bytes")
        body = original(self)
        # moto's rejectedLogEventsInfo: tooOldLogEventEndIndex is the last too-old event's index
        # (AWS: exclusive, one past it) and there is no expiredLogEventEndIndex (the retention).
        now = time.time() * 1000
        group = self.logs_backend.groups.get(self._get_param("logGroupName"))
        retention = getattr(group, "retention_in_days", None)
        stamps = [int(e.get("timestamp", 0)) for e in events]
        info: dict[str, int] = {}
        too_old = [i for i, t in enumerate(stamps) if t < now - 14 * 86_400_000]
        if too_old:
            info["tooOldLogEventEndIndex"] = too_old[-1] + 1
        expired = [i for i, t in enumerate(stamps) if retention and t < now - retention * 86_400_000]
        if expired:
            info["expiredLogEventEndIndex"] = expired[-1] + 1
        too_new = [i for i, t in enumerate(stamps) if t > now + 2 * 3_600_000]
        if too_new:
            info["tooNewLogEventStartIndex"] = too_new[0]
        doc = json.loads(body or "{}")
        doc.pop("rejectedLogEventsInfo", None)
        if info:
            doc["rejectedLogEventsInfo"] = info
        return json.dumps(doc)


def apply() -> None:
    """Install the CloudWatch Logs patches (idempotent)."""
    _patch_put_log_events_limits()
    _patch_log_stream_prefix()
