"""The object every command receives: resolved profile, region, UI and lazy AWS clients."""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from typing import Any

from petctl import config
from petctl.ui import UI


@dataclass
class Context:
    profile_flag: str | None = None
    region_flag: str | None = None
    local: bool = False
    ui: UI = field(default_factory=UI)
    _clients: Any = None
    _profile: config.Profile | None = None

    @property
    def profile_name(self) -> str:
        if self.local and not self.profile_flag:
            return config.LOCAL_PROFILE
        return config.resolve_profile_name(self.profile_flag)

    @property
    def profile(self) -> config.Profile:
        if self._profile is None:
            self._profile = config.load_profile(self.profile_name)
        return self._profile

    def reload_profile(self) -> config.Profile:
        self._profile = None
        return self.profile

    @property
    def region(self) -> str | None:
        return config.resolve_region(self.region_flag, self.profile)

    @property
    def user(self) -> str:
        try:
            return getpass.getuser()
        except Exception:  # noqa: BLE001 - no passwd entry in some containers
            return os.environ.get("USER", "unknown")

    def clients(self) -> Any:
        """boto3 client factory (imports boto3 on first use only)."""
        if self._clients is None:
            from petctl.aws import Clients

            p = self.profile
            # The local cloud never uses a named AWS profile: only its fake credentials.
            aws_profile = None if self.local else (p.aws_profile or p.name)
            self._clients = Clients(self.region, aws_profile=aws_profile, endpoint_url=p.endpoint_url)
        return self._clients
