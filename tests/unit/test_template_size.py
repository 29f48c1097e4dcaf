"""What petctl deploys fits CloudFormation: comments are stripped from the rendered templates
(the sources keep them) without changing what CloudFormation or bash reads, and every
combination of run-job options that changes the job template fits the cap of the way it is sent."""

from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest

from petctl import templates
from petctl.templates import rendering

# Every run-job option that changes the job template, each with every value it may take
# (instance_types: the most overrides there are, since each adds bytes).
JOB_OPTIONS = {
    "gpu": (False, True),
    "spot": (False, True),
    "ami_override": (False, True),
    "instance_types": tuple(range(1, 21)),
    "own_roles": (True, False),
    "bucket_kms": (False, True),
    "warm_pool": (False, True),
}
INFRA_OPTIONS = {"az_count": (1, 2, 3, 4, 5, 6), "create_efs": (True, False), "create_bucket": (True, False)}


def _combinations(options: dict) -> list[dict]:
    return [dict(zip(options, values)) for values in itertools.product(*options.values())]


def _job_variants() -> list[dict]:
    out = []
    for flags in _combinations(JOB_OPTIONS):
        try:
            templates.render_job(**flags)
        except ValueError:  # refused combinations (a warm pool with spot, KMS without own roles)
            continue
        out.append(flags)
    return out


def _with_comments(render, **flags) -> str:
    """The template exactly as the sources render it, comments and all."""
    original = rendering.strip_comments
    rendering.strip_comments = lambda text: text
    try:
        return render(**flags)
    finally:
        rendering.strip_comments = original


def test_every_job_variant_fits_the_template_url_cap_and_the_inline_cap():
    """Job stacks go by TemplateURL (1 MB), so the inline cap no longer binds them (the largest,
    stripped, is about 51 KB since the boot's give-up script and the per-job EFS resources).
    Without stripping, warm pool jobs were over the inline cap: what the issue measured."""
    variants = _job_variants()
    assert len(variants) > 400
    sizes = {tuple(f.values()): len(templates.render_job(**f).encode()) for f in variants}
    largest = max(sizes.values())
    assert largest <= templates.TEMPLATE_URL_MAX_BYTES
    unstripped = len(_with_comments(templates.render_job, warm_pool=True).encode())
    assert unstripped > templates.TEMPLATE_BODY_MAX_BYTES  # what the issue measured: refused inline


def test_every_base_variant_fits_inline():
    """The base stack is created inline (its bucket, where a TemplateURL would point, does not exist
    before it): every variant must fit the TemplateBody cap with room to grow."""
    for flags in _combinations(INFRA_OPTIONS):
        size = len(templates.render_infra(**flags).encode())
        assert size <= templates.TEMPLATE_BODY_MAX_BYTES * 0.5, (flags, size)


def _bash_ast(script: str, tmp_path) -> str:
    path = tmp_path / "script.sh"
    path.write_text(script)
    out = subprocess.run(["bash", "--pretty-print", str(path)], capture_output=True, text=True, check=True)
    # the pretty printer keeps a blank line where a comment was: blank lines carry no meaning here
    return "\n".join(line for line in out.stdout.splitlines() if line.strip())


def _scripts(data) -> list[str]:
    found = []
    if isinstance(data, dict):
        for v in data.values():
            found += _scripts(v)
    elif isinstance(data, list):
        for v in data:
            found += _scripts(v)
    elif isinstance(data, str) and data.startswith("#!"):
        found.append(data)
    return found


def _without_scripts(data):
    if isinstance(data, dict):
        return {k: _without_scripts(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_without_scripts(v) for v in data]
    if isinstance(data, str) and data.startswith("#!"):
        return "<script>"
    return data


STRIP_VARIANTS = [
    ("job", {}),
    ("job", {"gpu": True, "warm_pool": True}),
    ("job", {"spot": True, "instance_types": 3, "bucket_kms": True, "ami_override": True}),
    ("job", {"own_roles": False, "gpu": True}),
    ("infra", {"az_count": 3}),
    ("infra", {"az_count": 1, "create_efs": False, "create_bucket": False}),
]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(("stack", "flags"), STRIP_VARIANTS)
def test_stripping_changes_no_value_and_no_boot_script_command(stack, flags, tmp_path):
    render = templates.render_job if stack == "job" else templates.render_infra
    full, stripped = _with_comments(render, **flags), render(**flags)
    assert len(stripped) < len(full) * 0.8
    before, after = templates.load_template(full), templates.load_template(stripped)
    assert _without_scripts(after) == _without_scripts(before)
    scripts_before, scripts_after = _scripts(before), _scripts(after)
    assert len(scripts_after) == len(scripts_before) == (3 if stack == "job" else 0)
    for old, new in zip(scripts_before, scripts_after):
        assert new.startswith("#!/bin/bash\n")
        assert len(new) < len(old)
        assert _bash_ast(new, tmp_path) == _bash_ast(old, tmp_path)
        # here-documents are data (systemd units): kept byte for byte, comments included
        assert (
            "# A failed job must not loop forever" in new
            or "petctl-etcd.service" in new
            or "petctl cleanup: deleted" in new  # the checkpoint deletion has no here-document
        )


@pytest.mark.parametrize(
    ("source", "deployed"),
    [
        ("# head\nA: 1  # note\n\nB: 'x # y'\n", "A: 1\nB: 'x # y'\n"),
        ('C: "a #b"  # c\nD: [1, 2] # e\nE: a#b\n', 'C: "a #b"\nD: [1, 2]\nE: a#b\n'),
        # a folded description keeps its lines; a bash block loses comment lines only
        ("F: >-\n  # kept\n  text\nG: 1\n", "F: >-\n  # kept\n  text\nG: 1\n"),
        (
            "H: !Sub |\n  #!/bin/bash\n  # gone\n  echo 1 # stays\n  cat <<EOF\n  # data\n  EOF\n  # gone\nI: 2\n",
            "H: !Sub |\n  #!/bin/bash\n  echo 1 # stays\n  cat <<EOF\n  # data\n  EOF\nI: 2\n",
        ),
    ],
)
def test_strip_comments_cases(source, deployed):
    assert templates.strip_comments(source) == deployed


#: EC2 takes at most 16 KB of user data, raw, before base64 (RunInstances and launch templates:
#: "User data is limited to 16 KB"); moto takes any size. The rendered boot scripts carry
#: ``${...}`` references CloudFormation substitutes (names, ARNs, ids): 2 KB is kept for them.
USER_DATA_MAX_BYTES = 16 * 1024
SUBSTITUTION_ROOM = 2048


def test_every_boot_script_fits_ec2s_user_data_limit():
    largest: dict[str, int] = {}
    for flags in _job_variants():
        for script in _scripts(templates.load_template(templates.render_job(**flags))):
            role = "rdzv" if "BOOT_ROLE=rdzv" in script else "worker"
            largest[role] = max(largest.get(role, 0), len(script.encode()))
    assert set(largest) == {"rdzv", "worker"}
    for role, size in largest.items():
        assert size <= USER_DATA_MAX_BYTES - SUBSTITUTION_ROOM, (role, size)
