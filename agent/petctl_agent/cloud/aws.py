"""The agent's boto3 clients (S3 spec/code/status, Auto Scaling, CloudWatch Logs).

Only this module imports boto3, and only when a client is made: user scripts import
``petctl_agent.checkpoint`` and the CLI imports ``petctl_agent.spec``, and neither pays for it.
"""

from __future__ import annotations

import os
from typing import Any


def client(service: str, region: str | None = None) -> Any:
    """boto3 client honouring AWS_ENDPOINT_URL (boto3 does) with short timeouts and few retries."""
    import boto3
    from botocore.config import Config

    cfg = Config(connect_timeout=5, read_timeout=20, retries={"max_attempts": 3, "mode": "standard"})
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.client(service, region_name=region, config=cfg)
