"""What every part of the local cloud agrees on: its region, the fake AWS environment, the
control API's header. Standard library only (the CLI, the daemon and the reconciler import it)."""

from __future__ import annotations

import os

REGION = "us-east-1"

#: Environment a CLI process sets to talk to the local cloud, minus ``AWS_ENDPOINT_URL``.
#: The credentials are fake on purpose (moto accepts anything), and the AWS config and
#: credentials files are pointed at /dev/null so no real profile can leak in.
LOCAL_ENV: dict[str, str] = {
    "AWS_ACCESS_KEY_ID": "petctl-local",
    "AWS_SECRET_ACCESS_KEY": "petctl-local",
    "AWS_SESSION_TOKEN": "petctl-local",
    "AWS_REGION": REGION,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}

#: Variables that would make boto3 look for real credentials; :func:`activate` removes them.
LOCAL_ENV_UNSET: tuple[str, ...] = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
)

CONTROL_TOKEN_HEADER = "X-Petctl-Control-Token"

#: moto's default account: the local cloud's account id.
ACCOUNT_ID = "123456789012"
