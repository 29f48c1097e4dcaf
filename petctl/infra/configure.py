"""``petctl configure``: record existing resources in the profile."""

from __future__ import annotations

from typing import Any

from petctl import config, naming
from petctl.context import Context


def configure(ctx: Context, values: dict[str, Any]) -> dict[str, Any]:
    """Record existing resources in the profile after validating each value."""
    profile = ctx.profile
    for key, value in values.items():
        if value in (None, "", []):
            continue
        setattr(profile, key, config.validate_field(key, value))
    if not profile.log_group:
        profile.log_group = naming.log_group(profile.name)
    path = config.save_profile(profile)
    data = profile.to_dict()
    data["profile_path"] = str(path)
    data["missing_for_jobs"] = profile.missing_for_jobs()
    return data
