"""Data parallel under ``torchrun``: joining the process group and summing across ranks
(draft_trainer/train.py says how the loss and gradients are normalised)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def join_ranks(device: torch.device) -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group when WORLD_SIZE > 1: NCCL when this rank
    trains on CUDA, gloo on CPU (also where CUDA is visible but device=cpu: NCCL cannot reduce CPU tensors)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def all_reduce_sum(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """``tensor`` summed over the ranks, in place (itself when there is one rank)."""
    if world > 1:
        dist.all_reduce(tensor)
    return tensor
