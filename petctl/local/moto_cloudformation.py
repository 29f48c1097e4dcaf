"""CloudFormation in moto held to AWS's rules: template size and location caps, RetainExceptOnCreate.

Part of :mod:`petctl.local.moto_patches` (its items 8 and 9):

* **Template caps**: CloudFormation refuses an inline ``TemplateBody`` over 51,200 bytes, a
  ``TemplateURL`` object over 1 MB, and a ``TemplateURL`` that is not an https URL of an S3 object
  in a bucket of the stack's region (CreateStack/UpdateStack API reference). moto takes any body,
  and fetches any URL from its own S3 (the bucket name guessed from the host).
* **DeletionPolicy RetainExceptOnCreate**: AWS keeps such a resource when its stack is deleted,
  except when the operation that created it fails (a failed first create leaves nothing). moto
  knows only ``Retain``, so it deleted these resources with every stack.

What moto's CloudFormation lacks for single resource types lives beside their service: EFS access
points (:mod:`petctl.local.moto_efs`), a subnet's ``MapPublicIpOnLaunch`` (:mod:`petctl.local.moto_ec2`),
a group's hooks (:mod:`petctl.local.moto_hooks`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from petctl.local.patching import wrap

#: An S3 object URL CloudFormation takes: virtual-hosted (``bucket.s3.region.amazonaws.com/key``)
#: or path style (``s3.region.amazonaws.com/bucket/key``); no region means us-east-1.
_S3_VIRTUAL = re.compile(
    r"^(?P<bucket>[a-z0-9][a-z0-9.-]*)\.s3(?:[.-](?P<region>[a-z0-9-]+))?\.amazonaws\.com(?:\.cn)?$"
)
_S3_PATH = re.compile(r"^s3(?:[.-](?P<region>[a-z0-9-]+))?\.amazonaws\.com(?:\.cn)?$")


def _patch_template_limits() -> None:
    from urllib.parse import urlparse

    from moto.cloudformation.exceptions import ValidationError
    from moto.cloudformation.responses import CloudFormationResponse
    from moto.s3.models import s3_backends

    from petctl.templates.rendering import TEMPLATE_BODY_MAX_BYTES, TEMPLATE_URL_MAX_BYTES

    def check_body(self: Any) -> None:
        body = self._get_param("TemplateBody")
        if body is not None and len(body.encode("utf-8")) > TEMPLATE_BODY_MAX_BYTES:
            raise ValidationError(
                message=f"1 validation error detected: Value at 'templateBody' failed to satisfy constraint: "
                f"Member must have length less than or equal to {TEMPLATE_BODY_MAX_BYTES}"
            )

    for action in ("create_stack", "update_stack", "create_change_set", "validate_template"):

        @wrap(CloudFormationResponse, action)
        def checked(original: Callable[[Any], Any], self: Any) -> Any:
            check_body(self)
            return original(self)

    @wrap(CloudFormationResponse, "_get_stack_from_s3_url")
    def from_s3(original: Callable[[Any, str], str], self: Any, template_url: str) -> str:
        url = urlparse(template_url)
        host = url.hostname or ""
        virtual, path = _S3_VIRTUAL.match(host), _S3_PATH.match(host)
        if url.scheme != "https" or not (virtual or path):
            raise ValidationError(message="TemplateURL must be a supported URL (https, an Amazon S3 object)")
        if virtual:
            bucket_name, key, url_region = virtual["bucket"], url.path.lstrip("/"), virtual["region"]
        else:
            bucket_name, _, key = url.path.lstrip("/").partition("/")
            url_region = path["region"] if path else None
        backend = s3_backends[self.current_account][self.partition]
        try:
            bucket = backend.get_bucket(bucket_name)
            obj = backend.get_object(bucket_name, key)
        except Exception:  # noqa: BLE001 - NoSuchBucket, NoSuchKey
            obj = None
        if obj is None:
            raise ValidationError(
                message="TemplateURL must reference a valid S3 object to which you have access."
            )
        if bucket.region_name != self.region or (url_region or "us-east-1") != bucket.region_name:
            raise ValidationError(
                message=f"TemplateURL {template_url}: the bucket must be in the stack's region ({self.region}) "
                f"and addressed through it; it is in {bucket.region_name}"
            )
        if len(obj.value) > TEMPLATE_URL_MAX_BYTES:
            raise ValidationError(message=f"Template may not exceed {TEMPLATE_URL_MAX_BYTES} bytes in size.")
        return obj.value.decode("utf-8")


def _patch_retain_except_on_create() -> None:
    from moto.cloudformation.models import Stack

    @wrap(Stack, "delete")
    def delete(original: Callable[[Any], None], self: Any) -> None:
        created = self.status not in ("CREATE_IN_PROGRESS", "CREATE_FAILED", "ROLLBACK_IN_PROGRESS")
        created = created and not self.status.startswith("ROLLBACK")
        for resource in self.resource_map._resource_json_map.values():
            if resource.get("DeletionPolicy") == "RetainExceptOnCreate" and created:
                resource["DeletionPolicy"] = "Retain"  # moto's delete keeps exactly these
        original(self)


def apply() -> None:
    """Install the CloudFormation patches (idempotent)."""
    _patch_retain_except_on_create()
    _patch_template_limits()
