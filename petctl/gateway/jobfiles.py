"""What a job's instances publish under its S3 prefix: agent reports, boot logs, boot events;
and, at kill-job, the deletion of the whole prefix (docs/contracts.md). Reading never fails a ``status``: a warning instead."""

from __future__ import annotations

import json
from typing import Any

from petctl import naming
from petctl.errors import describe_client_error
from petctl.gateway.objects import Objects
from petctl.ui import UI

#: How much of the newest boot log is read: its end says why the boot failed.
BOOT_LOG_TAIL_BYTES = 16384


class JobFiles:
    def __init__(self, objects: Objects, bucket: str | None, ui: UI) -> None:
        self.objects = objects
        self.bucket = bucket
        self.ui = ui

    def read_status(self, job: str) -> list[dict[str, Any]]:
        """Every agent's report (``status/<instance-id>.json``)."""
        return self._json(job, "status/", "agent status")

    def boot_events(self, job: str) -> list[dict[str, Any]]:
        """Every boot's events document (``boot/events/<instance-id>.json``)."""
        return self._json(job, "boot/events/", "boot events")

    def boot_logs(self, job: str) -> tuple[list[dict[str, Any]], bytes]:
        """The boot logs failing instances published (``boot/<instance-id>.log``) and the end of
        the newest one; ``([], b"")`` when there are none or they cannot be read."""
        if not self.bucket:
            return [], b""
        prefix = naming.job_prefix(job) + "boot/"
        try:
            logs = [o for o in self.objects.listing(self.bucket, prefix) if o["Key"].endswith(".log")]
            if not logs:
                return [], b""
            newest = max(
                logs, key=lambda o: (o.get("LastModified") is not None, o.get("LastModified"), o["Key"])
            )
            logs.remove(newest)
            return [*logs, newest], self.objects.tail(self.bucket, newest["Key"], BOOT_LOG_TAIL_BYTES)
        except Exception as e:  # noqa: BLE001 - status must still show the group
            self.ui.warn(
                f"could not read boot logs from s3://{self.bucket}/{prefix}: {describe_client_error(e)}"
            )
            return [], b""

    def boot_log(self, job: str, instance_id: str) -> bytes | None:
        """The whole boot log a failing instance published (``boot/<instance-id>.log``), or None."""
        if not self.bucket:
            return None
        return self.objects.read(self.bucket, f"{naming.job_prefix(job)}boot/{instance_id}.log")

    def clear_reports(self, job: str) -> None:
        """A reused job name must not inherit the previous run's reports (kill-job keeps the prefix)."""
        if self.bucket:
            for stale in ("status/", "boot/"):
                self.objects.delete_prefix(self.bucket, naming.job_prefix(job) + stale)

    def spec_region(self, job: str) -> str | None:
        """The region the job's uploaded spec (``job.json``) names, or None (no spec, unreadable)."""
        if not self.bucket:
            return None
        try:
            data = self.objects.read(self.bucket, naming.job_prefix(job) + "job.json")
            region = json.loads(data).get("region") if data else None
            return str(region) if region else None
        except Exception:  # noqa: BLE001 - no answer: the caller decides without it
            return None

    def delete_all(self, job: str) -> None:
        """Everything under the job's prefix (``kill-job``, once no instance of it can start any
        more): its uploads, the TLS keys (secrets), the reports. Checkpoints are on EFS, worker
        lines in CloudWatch Logs: neither is here."""
        if not self.bucket:
            return
        prefix = naming.job_prefix(job)
        try:
            self.objects.delete_prefix(self.bucket, prefix)
        except Exception as e:  # noqa: BLE001 - the job is gone either way; say what is left
            self.ui.warn(
                f"could not delete s3://{self.bucket}/{prefix} ({describe_client_error(e)}); delete it by hand"
            )

    def _json(self, job: str, sub: str, what: str) -> list[dict[str, Any]]:
        if not self.bucket:
            return []
        try:
            return self.objects.read_json_objects(self.bucket, naming.job_prefix(job) + sub)
        except Exception as e:  # noqa: BLE001 - status must still show the group
            self.ui.warn(f"could not read {what} from s3://{self.bucket}: {describe_client_error(e)}")
            return []
