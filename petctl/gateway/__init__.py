"""Every AWS call petctl makes goes through here, behind methods that say what they do.

:class:`Gateway` hands out one small class per service (stacks, groups, compute, objects, job
files, logs, file systems, keys), each built on a client from the injected
:class:`~petctl.gateway.session.Clients` factory, so tests pass a moto server (or a stub) the
same way. Paginators, retries and AWS's error codes stay inside this package; nothing else in
petctl imports boto3 or names a service. A new AWS call goes into the class of its service.

Importing this module imports no boto3: the classes are built, and their modules imported, on
first use (``petctl --help`` stays fast).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from petctl.ui import UI

if TYPE_CHECKING:
    from petctl.gateway.compute import Compute
    from petctl.gateway.efs import FileSystems
    from petctl.gateway.groups import Groups
    from petctl.gateway.identity import Keys
    from petctl.gateway.jobfiles import JobFiles
    from petctl.gateway.logs import Logs
    from petctl.gateway.objects import Objects
    from petctl.gateway.stacks import Stacks


class Gateway:
    """The AWS account (or the local cloud) as petctl sees it.

    Args:
        clients: a ``Clients`` factory (``clients("s3")`` -> a boto3 client), with ``region``
            and ``check_credentials()``.
        ui: where waits show their progress.
        bucket: the profile's bucket, which job files are read from.
        sleep, clock: injected so tests drive waits without time passing.
    """

    def __init__(
        self,
        clients: Any,
        ui: UI,
        bucket: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clients = clients
        self.ui = ui
        self.bucket = bucket
        self.sleep = sleep
        self.clock = clock

    @property
    def region(self) -> str | None:
        return self.clients.region

    def check_credentials(self) -> str:
        """The caller's account id, or a one-line error."""
        return self.clients.check_credentials()

    @cached_property
    def stacks(self) -> Stacks:
        from petctl.gateway.stacks import Stacks

        return Stacks(self.clients("cloudformation"), self.ui, sleep=self.sleep, clock=self.clock)

    @cached_property
    def groups(self) -> Groups:
        from petctl.gateway.groups import Groups

        return Groups(self.clients("autoscaling"))

    @cached_property
    def compute(self) -> Compute:
        from petctl.gateway.compute import Compute

        return Compute(self.clients("ec2"), self.region)

    @cached_property
    def objects(self) -> Objects:
        from petctl.gateway.objects import Objects

        return Objects(self.clients("s3"))

    @property
    def job_files(self) -> JobFiles:
        from petctl.gateway.jobfiles import JobFiles

        return JobFiles(self.objects, self.bucket, self.ui)

    @cached_property
    def logs(self) -> Logs:
        from petctl.gateway.logs import Logs

        return Logs(self.clients("logs"))

    @cached_property
    def file_systems(self) -> FileSystems:
        from petctl.gateway.efs import FileSystems

        return FileSystems(self.clients("efs"), self.compute.subnet_vpc, sleep=self.sleep, clock=self.clock)

    @cached_property
    def keys(self) -> Keys:
        from petctl.gateway.identity import Keys

        return Keys(self.clients("kms"))
