"""petctl_agent.distributed.select_device: backend and device per rank (pure; no GPU needed)."""

from __future__ import annotations

import pytest

from petctl_agent.distributed import MIXED_BACKEND, DevicePlan, select_device


def test_cpu_only_machine_uses_gloo_on_cpu() -> None:
    assert select_device({"LOCAL_RANK": "3"}, False, 0) == DevicePlan("gloo", "cpu", 3)
    assert select_device({}, False, 0).local_rank == 0  # plain python: LOCAL_RANK unset


def test_gpu_rank_binds_its_local_rank_with_nccl_and_gloo() -> None:
    plan = select_device({"LOCAL_RANK": "2"}, True, 8)
    assert plan == DevicePlan(MIXED_BACKEND, "cuda:2", 2) and plan.cuda_index == 2
    assert MIXED_BACKEND == "cpu:gloo,cuda:nccl"
    assert select_device({"LOCAL_RANK": "0"}, True, 1).device == "cuda:0"


def test_explicit_backends() -> None:
    assert select_device({"LOCAL_RANK": "1"}, True, 2, "nccl").device == "cuda:1"
    gloo = select_device({"LOCAL_RANK": "5"}, True, 2, "gloo")  # CPU training on a GPU box
    assert gloo.device == "cpu" and gloo.cuda_index is None
    with pytest.raises(ValueError, match="needs CUDA"):
        select_device({"LOCAL_RANK": "0"}, False, 0, "nccl")


def test_more_local_ranks_than_gpus_is_an_error_naming_the_numbers() -> None:
    with pytest.raises(
        ValueError, match=r"LOCAL_RANK=2 but only 2 GPU\(s\).*CUDA_VISIBLE_DEVICES=0,1.*two ranks on one GPU"
    ):
        select_device({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, True, 2)
    with pytest.raises(ValueError, match="LOCAL_RANK=1 but only 1 GPU"):
        select_device({"LOCAL_RANK": "1"}, True, 1)


def test_bad_local_rank() -> None:
    with pytest.raises(ValueError, match="integer"):
        select_device({"LOCAL_RANK": "x"}, True, 2)
    with pytest.raises(ValueError, match=">= 0"):
        select_device({"LOCAL_RANK": "-1"}, False, 0)
