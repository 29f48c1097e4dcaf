"""Safety net for every test: fake credentials, no instance metadata, a private PETCTL_HOME.

No test may reach real AWS. If a test forgets to point boto3 at moto, the default
endpoint below (a closed loopback port) makes its AWS calls fail at once.
"""

from __future__ import annotations

import os
import tempfile

_HOME = tempfile.mkdtemp(prefix="petctl-test-home-")

for _k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "PETCTL_PROFILE"):
    os.environ.pop(_k, None)
os.environ.update(
    {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.path.join(_HOME, "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": os.path.join(_HOME, "aws-credentials"),
        "PETCTL_HOME": _HOME,
        "PETCTL_LOCAL_DIR": os.path.join(_HOME, "local"),
    }
)
os.environ.setdefault("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
