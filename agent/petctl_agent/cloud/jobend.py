"""What the job's S3 prefix loses when the job ends: the etcd CA key.

``tls/ca.key`` signs etcd server certificates for the job's rendezvous address. The rendezvous
instance signs at boot and deletes its local copy, but a *replaced* rendezvous instance needs the
key again (same address, new certificate), so it must stay in S3 for the job's whole life -- and
no longer: once the job has ended (succeeded, or failed for good) and its groups are at zero, no
instance can boot for it, and the agents delete the key. The worker role may delete exactly that
object (``s3:DeleteObject`` on ``petctl/jobs/<job>/tls/ca.key``, nothing else). Everything else
under the prefix stays until ``kill-job``: status and boot reports are what ``petctl status`` and
``timeline`` of a finished job read; code, spec and wheel are inputs the worker role may not touch
(one node, running user code, must not be able to change or remove what the others boot from).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("petctl_agent")

CA_KEY = "tls/ca.key"


def ca_key_location(status_url: str) -> tuple[str, str] | None:
    """``(bucket, key)`` of the job's CA key, from its ``s3://<bucket>/<job prefix>status/`` URL."""
    u = urlparse(status_url)
    prefix = u.path.lstrip("/")
    if u.scheme != "s3" or not u.netloc or not prefix.endswith("/status/"):
        return None
    return u.netloc, prefix[: -len("status/")] + CA_KEY


def forget_ca_key(spec: Any, client_factory: Callable[[str], Any]) -> bool:
    """Delete the job's CA key once no rendezvous instance can boot for it any more; True if deleted.

    Only when the rendezvous group is at zero (desired and minimum): should the scale-down have
    failed, a replacement rendezvous instance would still need the key (kill-job deletes it then).
    Never fatal: the job's outcome is already decided.
    """
    where = ca_key_location(getattr(spec, "status_url", "") or "")
    if where is None:
        return False
    bucket, key = where
    try:
        if spec.rdzv_group:
            groups = client_factory("autoscaling").describe_auto_scaling_groups(
                AutoScalingGroupNames=[spec.rdzv_group]
            )["AutoScalingGroups"]
            if groups and (groups[0]["DesiredCapacity"] or groups[0]["MinSize"]):
                log.warning(
                    "kept s3://%s/%s: %s is not at zero yet (kill-job deletes it)",
                    bucket,
                    key,
                    spec.rdzv_group,
                )
                return False
        client_factory("s3").delete_object(Bucket=bucket, Key=key)
        log.info("deleted s3://%s/%s: the job has ended, no rendezvous instance will sign again", bucket, key)
        return True
    except Exception as e:  # noqa: BLE001 - best effort: kill-job deletes the whole prefix
        log.warning("could not delete s3://%s/%s (kill-job deletes it): %s", bucket, key, e)
        return False
