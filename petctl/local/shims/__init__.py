"""Host-command shims of the local cloud: what a local instance's boot script runs instead of
``dnf``, ``mount``, ``systemctl``, ``aws``, ``curl``, ``ip``, ``python3.11``, ``pip`` and ``shutdown``.

Every instance of the local cloud boots by running the user data of its launch template (the
same bash AWS runs; see :mod:`petctl.local.boot`). Its ``PATH`` starts with a per-instance
``bin/`` of small wrappers, ``exec <python> -I .../shims/__main__.py <command> "$@"``. Each shim
does exactly what the boot scripts need, against the local cloud (moto for AWS calls, the
instance's IMDS emulator, the ``efs/`` directory, the daemon's systemd emulation), and **refuses
anything else loudly** (exit 2 with ``<command> (petctl local shim): …`` on stderr), so a boot
script that starts to depend on something the local cloud does not model fails its tests instead
of silently passing. docs/local.md lists each shim and what it refuses.

Standard library only at import time (boto3, jmespath and packaging are imported by the shims
that need them): the boot runs a dozen of these, and each costs a Python start.

One module per shim: :mod:`.dnf`, :mod:`.mount`, :mod:`.systemctl`, :mod:`.aws` (its calls in
:mod:`.s3` and :mod:`.aws_calls`), :mod:`.net` (``curl``, ``ip``), :mod:`.venv` (``python3.11``)
and :mod:`.pip`, :mod:`.power` (``shutdown``); :mod:`.main` picks one by name, :mod:`.base` is what they share.

Context (set by the reconciler in the boot script's environment):

``PETCTL_LOCAL_ROOT``           the instance's root directory (``/etc``, ``/opt``, … map into it)
``PETCTL_LOCAL_STATE``          the local cloud's state dir (``efs/``, ``venvs/``)
``PETCTL_LOCAL_IMDS``           the instance's IMDS base URL (``http://127.0.0.1:<port>/<id>``)
``PETCTL_LOCAL_INSTANCE_ID``    the instance id; ``PETCTL_LOCAL_AZ`` its availability zone
``PETCTL_LOCAL_JOB``            its ``petctl:job`` tag (the per-job environment cache key)
``PETCTL_LOCAL_SYSTEMD``        the daemon's systemd endpoint for this instance, and
``PETCTL_LOCAL_SYSTEMD_TOKEN``  the token it requires
"""

from .base import SCRIPT, Failed, Refused
from .main import refusals_file
from .mount import efs_mount, fstab_entry, mounted
from .systemctl import WANTS, parse_unit

__all__ = [
    "SCRIPT",
    "WANTS",
    "Failed",
    "Refused",
    "efs_mount",
    "fstab_entry",
    "mounted",
    "parse_unit",
    "refusals_file",
]
