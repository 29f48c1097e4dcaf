"""A job whose workers fail says why, in the worker's own words, and stops at once when
the failure is deterministic; a project's files are found by relative paths from the work dir.

Real agents, a real etcd, real torch workers (bench/harness.py):

- a script that raises on every rank (the pytorch/examples case: a data file read by a path
  relative to the project, run from the shared work dir): the job fails after the second
  identical failure, well within a minute and with its restart budget (10) unspent, and the
  reason (the agents' and ``petctl status``'s) carries the exception line, the rank and the
  instance, and the command that prints the rest; never torch's "To enable traceback";
- a script that prints its traceback and calls ``sys.exit(1)`` (as hydra's ``@hydra.main``
  does: torch gets no error file), and one that raises with the forkserver off (fresh
  interpreters, no ``@record``): the line comes from the rank's stderr;
- a project directory whose script reads ``data/input.txt`` relatively and writes a relative
  output: it succeeds on 2 nodes, and the output is in the shared work dir.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import pytest

from petctl_agent import EXIT_TERMINAL

pytestmark = pytest.mark.e2e

LINE = "FileNotFoundError: [Errno 2] No such file or directory: 'data/input.txt'"
READS_DATA = (
    "import os\nprint('rank', os.environ['RANK'], 'starting', flush=True)\nopen('data/input.txt').read()\n"
)


def _use_script(c, text: str, **spec: object) -> None:
    script = c.tmp / "code" / "fail.py"
    script.write_text(text)
    doc = json.loads(c.spec_path.read_text())
    doc.update(code_url=f"file://{script}", script="fail.py", **spec)
    c.spec_path.write_text(json.dumps(doc))


def _ended(c, nodes, timeout: float) -> float:
    t0 = time.monotonic()
    c.wait(lambda: all(n.proc.poll() is not None for n in nodes), timeout, "every agent to end")
    return time.monotonic() - t0


def _failed(c, node) -> dict:
    st = c.status(node.instance_id) or {}
    assert node.proc.returncode == EXIT_TERMINAL and st.get("state") == "FAILED", (node.proc.returncode, st)
    return st


def test_a_script_that_raises_on_every_rank_fails_at_once_with_its_error(make_cluster) -> None:
    from petctl.jobs.reasons import agent_failure_reason

    c = make_cluster(job="raises", min_nodes=2, max_nodes=2, spec_extra={"max_restarts": 10})
    _use_script(c, READS_DATA)
    a, b = c.add_node(), c.add_node()
    took = _ended(c, [a, b], 120)
    docs = [_failed(c, n) for n in (a, b)]
    reasons = [d["reason"] for d in docs]
    assert all(LINE in r for r in reasons), reasons
    assert not any("To enable traceback" in r for r in reasons), reasons
    # the node that decided says so; a node whose rendezvous it closed says its own error first
    assert any("the same error twice in a row" in r for r in reasons), reasons
    for d in docs:
        assert f" on {d['instance_id']} exit 1: " in d["reason"], d["reason"]
        failed = [e for e in d["events"] if e["kind"] == "workers_failed"]
        assert 1 <= len(failed) <= 3 and all(LINE in e["failures"] for e in failed), failed
        assert (d.get("restarts") or 0) <= 2, d  # not the 10 of the budget
    assert took < 60, f"the job took {took:.0f}s to fail"
    # what `petctl status` and `run-job --wait` say: the line, the node, and where the rest is
    job_reason = agent_failure_reason(docs, "raises")
    assert LINE in job_reason and "logs raises --instance i-000" in job_reason, job_reason
    assert "the rendezvous was closed" not in job_reason.split(LINE)[0], job_reason


def test_an_error_printed_before_sys_exit_is_the_reason(make_cluster) -> None:
    """hydra's ``@hydra.main`` prints the traceback and exits 1: torch has no error file."""
    c = make_cluster(job="hydra", min_nodes=1, max_nodes=1, spec_extra={"max_restarts": 10})
    _use_script(
        c,
        "import sys, traceback\n"
        "def main():\n"
        "    raise ValueError('batch_size must be positive, got -1')\n"
        "try:\n"
        "    main()\n"
        "except Exception:\n"
        "    print('Error executing job with overrides: []', file=sys.stderr)\n"
        "    traceback.print_exc()\n"
        "    print('\\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.', file=sys.stderr)\n"
        "    sys.exit(1)\n",
    )
    a = c.add_node()
    assert _ended(c, [a], 120) < 60
    reason = _failed(c, a)["reason"]
    assert reason.startswith("rank 0 on i-0001 exit 1: ValueError: batch_size must be positive, got -1"), (
        reason
    )


def test_a_fresh_interpreter_s_error_is_read_from_its_stderr(make_cluster) -> None:
    """Forkserver off: torch starts ``python script.py`` (no ``@record``, no error file)."""
    c = make_cluster(
        job="spawned",
        min_nodes=1,
        max_nodes=1,
        spec_extra={"max_restarts": 10},
        extra_env={"PETCTL_AGENT_NO_FORKSERVER": "1"},
    )
    _use_script(c, READS_DATA)
    a = c.add_node()
    _ended(c, [a], 180)
    reason = _failed(c, a)["reason"]
    assert reason.startswith(f"rank 0 on i-0001 exit 1: {LINE}"), reason
    assert "the same error twice in a row" in reason, reason


PROJECT_TRAIN = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
text = open("data/input.txt").read()  # relative to the project, as under `cd project && torchrun`
t = torch.tensor([float(len(text))])
dist.all_reduce(t)
if dist.get_rank() == 0:
    os.makedirs("outputs", exist_ok=True)
    with open("outputs/result.txt", "w") as f:  # relative: the shared work dir
        f.write(f"{int(t.item())} {dist.get_world_size()} {os.getcwd()}\\n")
print("rank", dist.get_rank(), "read", len(text), flush=True)
dist.destroy_process_group()
"""


def _project_tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_project_reads_its_files_relatively_and_writes_to_the_shared_work_dir(make_cluster) -> None:
    c = make_cluster(job="project", min_nodes=2, max_nodes=2, spec_extra={"max_restarts": 0})
    tar = c.tmp / "code" / "code.tar.gz"
    tar.write_bytes(_project_tar({"train.py": PROJECT_TRAIN, "data/input.txt": "hello world\n"}))
    doc = json.loads(c.spec_path.read_text())
    doc.update(code_url=f"file://{tar}", code_kind="dir", script="train.py")
    c.spec_path.write_text(json.dumps(doc))
    nodes = [c.add_node(), c.add_node()]
    _ended(c, nodes, 180)
    c.assert_succeeded(nodes)
    out = c.work_dir / "outputs" / "result.txt"
    assert out.read_text().split() == ["24", "2", str(c.work_dir)], out.read_text()
    data = c.work_dir / "data"
    assert data.is_symlink() and (data / "input.txt").read_text() == "hello world\n"
    assert Path(str(data.readlink())).parent.name == "code"  # a node's own copy, not the shared dir
    assert not (c.work_dir / "outputs").is_symlink()  # the job's own output, shared
