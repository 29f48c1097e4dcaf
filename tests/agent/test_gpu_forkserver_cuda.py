"""The agent's forkserver never initialises CUDA before it forks a worker.

A process that initialised CUDA (even only ``cuInit``, e.g. via
``torch.cuda.is_available()``'s default ``cudaGetDeviceCount``) cannot hand a usable
CUDA to its forked children. The forkserver pre-imports ``petctl_agent.worker.forkserver.PRELOAD``;
this starts a real forkserver with exactly that list, forks a child from it, and in
the child checks, without initialising CUDA itself:

- ``torch.cuda.is_initialized()`` is False (torch's own lazy-init flag);
- GPUs are counted through NVML only (``torch.cuda._device_count_nvml()``, and
  ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` for ``is_available()``), after which it still holds;
- on a GPU, the forked child can then really use CUDA (a tensor on ``cuda:0``): a parent
  that had called ``cuInit`` would leave it "Cannot re-initialize CUDA in forked subprocess".

Whether ``libcuda`` is *mapped* is recorded but not a failure: on the H200 check, torch
2.11+cu130 maps the driver library at ``import torch`` without calling ``cuInit``, and
a mapped library is harmless to fork; only an initialised driver is.

On a CPU build of torch there is no CUDA to initialise (``_is_compiled()`` False); the
same check runs on the GPU machine through ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PROBE = textwrap.dedent(
    """
    import os


    def cuda_state():
        import torch

        def libcuda_mapped():
            with open("/proc/self/maps") as f:
                return any("libcuda.so" in line for line in f)

        out = {
            "compiled": torch.cuda._is_compiled(),
            "initialized_at_fork": torch.cuda.is_initialized(),
            "libcuda_at_fork": libcuda_mapped(),
        }
        if out["compiled"]:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
            out["nvml_device_count"] = torch.cuda._device_count_nvml()
            out["nvml_available"] = torch.cuda.is_available()
        out["initialized_after_check"] = torch.cuda.is_initialized()
        out["libcuda_after_check"] = libcuda_mapped()
        if out["compiled"] and out.get("nvml_device_count", 0) >= 1:
            try:
                out["child_cuda_ok"] = float(torch.ones(1, device="cuda:0").sum().item()) == 1.0
            except Exception as e:  # the proof that the parent poisoned CUDA
                out["child_cuda_ok"] = False
                out["child_cuda_error"] = str(e)[:300]
        return out


    def child(q):
        q.put(cuda_state())
    """
)

DRIVER = textwrap.dedent(
    """
    import json, multiprocessing as mp, sys
    from petctl_agent.worker.forkserver import PRELOAD
    import cudaprobe
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)   # exactly what the agent's forkserver pre-imports
    q = ctx.Queue()
    p = ctx.Process(target=cudaprobe.child, args=(q,))
    p.start()
    res = q.get(timeout=300)
    p.join(60)
    res["preload"] = PRELOAD
    print("RESULT " + json.dumps(res), flush=True)
    """
)


def run_probe(tmp: Path) -> dict:
    """Start a forkserver with PRELOAD, fork a child, return its CUDA state (used by gpu_check too)."""
    (tmp / "cudaprobe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    r = subprocess.run(
        [sys.executable, "-c", DRIVER], cwd=tmp, env=env, capture_output=True, text=True, timeout=400
    )
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"probe failed (rc {r.returncode}):\n{r.stderr[-3000:]}")


def check(res: dict) -> list[str]:
    """Problems in a probe result (empty: the forkserver left CUDA alone)."""
    problems = []
    for key in ("initialized_at_fork", "initialized_after_check"):
        if res.get(key):
            problems.append(f"{key} is true")
    if res.get("child_cuda_ok") is False:
        problems.append(f"the forked child cannot use CUDA: {res.get('child_cuda_error')}")
    if "torch._dynamo" not in res.get("preload", []):
        problems.append("PRELOAD changed: review this test")
    return problems


def test_forkserver_with_preload_does_not_initialize_cuda(tmp_path: Path) -> None:
    res = run_probe(tmp_path)
    assert check(res) == [], res
    if res["compiled"]:  # a CUDA build: NVML saw the GPUs without initialising CUDA
        assert res["nvml_device_count"] >= 0 and isinstance(res["nvml_available"], bool)
