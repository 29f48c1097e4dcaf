"""Run a user script inside a worker process forked from a pre-loaded forkserver.

Restart time of an elastic job is dominated by worker start-up: every restart
used to re-import torch (and ``torch._dynamo``, which ``torch.optim`` pulls in on
first use) in fresh interpreters -- 15-30 s per restart on a loaded 2-core box.
With ``PETCTL_AGENT_FORKSERVER`` (default on) the agent starts torch's workers
with the ``forkserver`` start method and a forkserver that has already imported
torch; each worker is a fork of it that runs the script with ``runpy`` as
``__main__``, with ``sys.argv`` and ``sys.path[0]`` as ``python script.py args``
would set them.

Process groups outlive ``destroy_process_group`` (the exit hang)
-----------------------------------------------------------------
PyTorch's DDP tutorial scripts end ``main()`` with ``destroy_process_group()``
while the ``Trainer`` that holds the DDP model is still a local of ``main``.
That call drops ``_world``'s reference, so the DDP ``Reducer`` holds the last
one; when ``main`` returns, the Reducer is freed by a pybind11 dealloc that
keeps the GIL, and ``~Reducer -> ~ProcessGroup -> ~ProcessGroupGloo`` joins
the gloo worker threads *with the GIL held*. A gloo thread that is still
dropping the last reference to the step's final allreduce ``AsyncWork`` must
take the GIL: the work captured the caller's ``at::ThreadLocalState``, which
holds the ``contextvars`` context that ``torch.autograd.graph._engine_run_backward``
stashes in TLS (``_stash_obj_in_tls("context", ...)``) as a ``SafePyObject``,
whose destructor acquires the GIL. Deadlock (py-spy: main thread
``std::thread::join <- ~ProcessGroupGloo <- ~Reducer <- pybind11_object_dealloc``
at the script's ``main(...)`` line; gloo thread ``gil_scoped_acquire <-
ConcretePyInterpreterVTable::decref <- ~ThreadLocalState <- ~AsyncWork <- runLoop``).

The race is torch's, but here only the forkserver hits it. Measured with 2 ranks on
gloo, each run bounded by a timeout (tests/agent/test_forkserver_exit.py; the
agent's ``start_processes`` path): before this fix the ``tutorial`` script hung in
11 of 20 forkserver restarts, a loop of the same pattern in 6 of 20 (and the
DDP tutorial-series script in 4 of 25); the same harness with ``spawn`` (fresh
interpreters) 0 of 27, a forkserver that preloads only ``torch`` 0 of 20, and
one that preloads ``torch`` + ``torch._dynamo`` 6 of 20 -- the preloaded
``torch._dynamo`` widens the window in which the gloo thread still owns the work.

A script that ends *without* ``destroy_process_group`` never runs ``~ProcessGroupGloo`` here at all: the
forkserver child leaves with ``os._exit`` after torch's return-value handoff,
so ``_world`` keeps every group alive (0 of 45); a fresh interpreter destroys
the groups during finalization, when a thread that asks for the GIL is made to
exit instead of waiting.

The fix makes a forkserver worker behave like that: ``run_script`` wraps
``torch.distributed.destroy_process_group`` so that the groups it destroys are
also kept referenced by this module. ``destroy_process_group`` still shuts
them down and forgets them (``is_initialized()`` is False, a new
``init_process_group`` works), but no Python dealloc inside the script can be
the last owner of a gloo backend, so its destructor -- the only place that
joins the gloo threads -- never runs with the GIL held. The worker process then
exits through the forkserver's ``os._exit`` without destructing them (as
before), which is what a fresh interpreter's finalization amounts to. The
cost: a script that destroys and re-creates groups many times keeps each old
group's idle threads and sockets until it exits. Set
``PETCTL_AGENT_NO_PG_KEEPALIVE=1`` to switch this off.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import json
import os
import runpy
import signal
import sys
import time

from petctl_agent.workarounds import switched_off

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.optim",
    "torch.nn.parallel",
    "torch._dynamo",
    "petctl_agent.worker.forkserver",
    # the checkpoint helper and its memory path (awscrt included): 0.07 s of imports on an idle
    # core that every restarted worker paid again, on the busiest cores of a membership change.
    # It reads no environment and starts no thread at import (tests/unit/test_forkserver_preload.py).
    "petctl_agent.checkpoint",
]

# process groups passed to destroy_process_group(); never released (see above)
_KEPT_GROUPS: list[object] = []


def keep_destroyed_groups_alive() -> bool:
    """Make ``torch.distributed.destroy_process_group`` keep a reference to every
    group it destroys (idempotent). Returns whether the wrapper is installed."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - torch without distributed: nothing to do
        return False
    real = c10d.destroy_process_group
    if getattr(real, "_petctl_keeps_groups", False):
        return True

    @functools.wraps(real)
    def destroy_process_group(group=None):  # noqa: ANN001, ANN202 - torch's signature
        try:
            if group is None or group == c10d.GroupMember.WORLD:
                # WORLD destroys every group; pg_map is where torch lists them
                world = getattr(c10d, "_world", None)
                _KEPT_GROUPS.extend(getattr(world, "pg_map", None) or [c10d.GroupMember.WORLD])
            elif group != c10d.GroupMember.NON_GROUP_MEMBER:
                _KEPT_GROUPS.append(group)
        except Exception:  # noqa: BLE001 - never change what destroy_process_group does
            pass
        return real(group)

    destroy_process_group._petctl_keeps_groups = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    return True


def connect_when_listening() -> bool:
    """Make torch's ``env://`` store client (a plain script's ``init_process_group()``) wait until
    rank 0's store listens before it connects (idempotent). Returns whether the wrapper is installed.

    torch's client meets a refused connection with an exponential backoff with jitter, so a rank
    that starts before rank 0's store listens -- after a membership change every rank starts at
    once -- connected 0.36-0.56 s (median) after it did (``bench/bench_store_connect.py``). The helper's
    own ``init_process_group`` waits the same way (``distributed.await_listener``); this gives a
    script that calls torch's its 10 ms poll too. Wraps the private
    ``torch.distributed.rendezvous._create_c10d_store``; a torch without it keeps its backoff."""
    try:
        rdzv = importlib.import_module("torch.distributed.rendezvous")
    except Exception:  # noqa: BLE001 - torch without distributed: nothing to do
        return False
    real = getattr(rdzv, "_create_c10d_store", None)
    if real is None:
        return False
    if getattr(real, "_petctl_waits", False):
        return True
    from petctl_agent.distributed import await_listener

    @functools.wraps(real)
    def _create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):  # noqa: ANN001, ANN202
        seconds = getattr(timeout, "total_seconds", None)
        if int(rank) != 0 and seconds is not None:
            await_listener(hostname, int(port), seconds())
        return real(hostname, port, rank, world_size, timeout, *args, **kwargs)

    _create_c10d_store._petctl_waits = True  # type: ignore[attr-defined]
    rdzv._create_c10d_store = _create_c10d_store
    return True


def _ready() -> None:
    """A no-op child: forking it proves the forkserver has finished its imports."""


def warm_forkserver(timeout: float = 300) -> float:
    """Start the torch-preloaded forkserver and wait until it has forked one child.

    The agent calls this *before* it first joins the rendezvous: a newcomer registers
    (which is what makes the running nodes stop) only once its workers can start at
    once, by forking from a server that already imported torch. Returns the seconds
    it took. ``multiprocessing.forkserver.ensure_running`` alone returns before the
    server's imports are done; the server accepts the first fork request only after.
    """
    import multiprocessing

    t0 = time.monotonic()
    multiprocessing.set_forkserver_preload(PRELOAD)
    p = multiprocessing.get_context("forkserver").Process(target=_ready, name="petctl-forkserver-warmup")
    p.start()
    p.join(timeout)
    return time.monotonic() - t0


def note_failure(e: BaseException) -> None:
    """Tell the agent at once that this worker is failing (``$PETCTL_FAILURE_FILE``): the process
    exits only after torch records the error and the kernel frees its memory, which takes
    0.6 s for 1 GiB of state and its snapshot mappings on an idle box, several seconds on a busy
    one (docs/benchmarks.md). The agent starts the hard-loss lease reads and joins the
    next round meanwhile (``PetctlElasticAgent``, "failing workers"). Best effort, atomic."""
    path = os.environ.get("PETCTL_FAILURE_FILE")
    if not path:
        return
    if os.path.exists(path):
        # a sibling rank noted first: keep its time and error (its failure began this node's; the
        # agent names the node a round's failure began on by that time, elastic/culprit.py)
        return
    body = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "t": time.time(),
            "error": f"{type(e).__name__}: {e}"[:300]}  # fmt: skip
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)
    except OSError:
        pass


def use_job_env(env: str) -> None:
    """Put the job's environment (its requirements, node/jobenv.py) first on ``sys.path``, its
    ``.pth`` files run: the forkserver runs that environment's python, but multiprocessing's
    forkserver starts by setting ``sys.path`` to the agent's, which lacks it."""
    if not env:
        return
    import glob
    import site

    for sp in glob.glob(os.path.join(env, "lib", "python3*", "site-packages")):
        if sp not in sys.path:
            site.addsitedir(sp)
            sys.path.remove(sp)
            sys.path.insert(0, sp)


def run_script(script: str, *args: str) -> None:
    """Entry point torch calls in each worker (must be importable/picklable)."""
    if not switched_off("PDEATHSIG", os.environ):
        # parent = the forkserver, which exits when the agent dies
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if not switched_off("PG_KEEPALIVE", os.environ):
        keep_destroyed_groups_alive()
    if not switched_off("STORE_CONNECT", os.environ):
        connect_when_listening()
    use_job_env(os.environ.get("PETCTL_JOB_ENV", ""))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code in (None, 0):
            return  # torch waits for a return value from a successful worker
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    except BaseException as e:
        note_failure(e)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
