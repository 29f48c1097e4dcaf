"""S3 in moto held to AWS's request caps: DeleteObjects takes at most 1,000 keys.

Part of :mod:`petctl.local.moto_patches` (its item 5b): AWS answers ``MalformedXML`` to a
DeleteObjects request of more than 1,000 keys; moto took any number, so ``Objects.delete_prefix``
sending too many at once would pass locally and fail on AWS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from petctl.local.patching import wrap


def _patch_delete_objects_cap() -> None:
    from moto.s3.exceptions import MalformedXML
    from moto.s3.responses import S3Response

    @wrap(S3Response, "_bucket_response_delete_keys")
    def delete_keys(original: Callable[..., Any], self: Any, bucket_name: str, *args: Any, **kw: Any) -> Any:
        if self.body and self.body.count(b"<Object>") > 1000:  # AWS: MalformedXML over 1,000 keys
            raise MalformedXML()
        return original(self, bucket_name, *args, **kw)


def apply() -> None:
    """Install the S3 patch (idempotent)."""
    _patch_delete_objects_cap()
