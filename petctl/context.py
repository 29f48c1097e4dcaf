"""The object every command receives: resolved profile, region, UI and lazy AWS clients."""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from petctl import config
from petctl.errors import ConfigError
from petctl.ui import UI

if TYPE_CHECKING:
    from petctl.gateway import Gateway


@dataclass
class Context:
    profile_flag: str | None = None
    region_flag: str | None = None
    local: bool = False
    ui: UI = field(default_factory=UI)
    _clients: Any = None
    _gateway: Any = None
    _local_active: bool = False
    _profile: config.Profile | None = None
    #: Job commands act on one existing profile: a typo in --profile must never reach the jobs
    #: of another one. Only setup/configure/profiles may start from a profile that does not exist.
    profile_must_exist: bool = False

    @property
    def profile_name(self) -> str:
        if self.local and not self.profile_flag:
            return config.LOCAL_PROFILE
        return config.resolve_profile_name(self.profile_flag)

    @property
    def profile(self) -> config.Profile:
        if self._profile is None:
            # The local cloud's own profile is made on first use (activate_local), so a newcomer's
            # first `petctl --local ...` needs no setup step for the profile itself.
            implicit = self.local and not self.profile_flag
            self._profile = config.load_profile(
                self.profile_name, must_exist=self.profile_must_exist and not implicit
            )
        return self._profile

    @property
    def region(self) -> str | None:
        region = config.resolve_region(self.region_flag, self.profile)
        p = self.profile
        if p.region and region != p.region and (p.stack_name or p.subnet_ids):
            # The profile's resources live in one region; another region would find none of them.
            raise ConfigError(
                f"profile {p.name!r} lives in {p.region}, but the region asked for is {region} "
                f"(--region, AWS_REGION or AWS_DEFAULT_REGION); use --region {p.region} or another --profile"
            )
        return region

    @property
    def user(self) -> str:
        try:
            return getpass.getuser()
        except Exception:  # noqa: BLE001 - no passwd entry in some containers
            return os.environ.get("USER", "unknown")

    def activate_local(self) -> None:
        """Point this process's AWS calls at the local cloud, starting it on first use.

        Called lazily (first AWS call), so ``--help`` and bad input never start it.
        """
        if not self.local or self._local_active:
            return
        from petctl import local as local_cloud

        self.ui.progress("using the local cloud (no AWS account is touched)")
        local_cloud.activate(timeout=90)  # importing moto takes 10-30 s on a busy 2-core machine
        self._local_active = True
        profile = self.profile
        if profile.region is None or profile.vpc_cidr is None:
            profile.region = profile.region or local_cloud.REGION
            # moto hands out private IPs from the VPC CIDR; 127.0.0.0/16 makes them real loopback addresses.
            profile.vpc_cidr = profile.vpc_cidr or "127.0.0.0/16"
            config.save_profile(profile)

    def gateway(self) -> Gateway:
        """The AWS account (or the local cloud) behind typed methods; built on first use."""
        from petctl.gateway import Gateway

        if self._gateway is None:
            self._gateway = Gateway(self.clients(), self.ui)
        self._gateway.bucket = self.profile.bucket  # setup and configure change it
        return self._gateway

    def clients(self) -> Any:
        """boto3 client factory (imports boto3 on first use only)."""
        self.activate_local()
        if self._clients is None:
            from petctl.gateway.session import Clients

            p = self.profile
            # The local cloud never uses a named AWS profile: only its fake credentials.
            aws_profile = None if self.local else (p.aws_profile or p.name)
            self._clients = Clients(
                self.region,
                aws_profile=aws_profile,
                endpoint_url=p.endpoint_url,
                debug=self.ui.debug if self.ui.debug_enabled else None,
            )
        return self._clients
