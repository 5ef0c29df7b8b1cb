"""Data parallel under ``torchrun``: joining the process group and summing across ranks
(draft_trainer/train.py says how the loss and gradients are normalised)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


def join_ranks(device: torch.device) -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group when WORLD_SIZE > 1: NCCL when this rank
    trains on CUDA, gloo on CPU (also where CUDA is visible but device=cpu: NCCL cannot reduce CPU tensors)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    watch_launcher()
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


LAUNCHER_POLL_S = 1.0


def watch_launcher(poll_s: float = LAUNCHER_POLL_S) -> threading.Thread:
    """A rank outlives nothing: torchrun starts each rank in a session of its own, so a launcher killed
    by SIGKILL (or a scheduler that kills only it) left the ranks training on, orphaned, holding the run
    directory and the cache's locks, which refused the rerun. A daemon thread polls the parent pid and
    SIGKILLs this rank once the parent is gone (reparented). SIGKILL loses nothing that a killed job
    would not: checkpoints and cache shards are written crash-safe. Only for ranks (a one-process
    ``eagle3 train`` under nohup outlives its shell on purpose)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="eagle3-launcher-watch", daemon=True)
    thread.start()
    return thread


def any_rank(flag: bool, world: int, device: torch.device) -> bool:
    """True on every rank when ``flag`` is True on any: one decision all ranks act on together (a SIGTERM
    reaches the ranks at different moments; a rank that stopped alone would leave the others waiting in
    a collective, and the checkpoint would be lost)."""
    if world == 1:
        return flag
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value)
    return bool(value.item() > 0)


def all_reduce_grads(params: Sequence[torch.Tensor], world: int) -> None:
    """Sum every parameter's gradient over the ranks, in one collective, with the same result as one
    process that ran every rank's micro-batches: a gradient that no rank computed stays ``None`` (AdamW
    then leaves that parameter alone), one that some rank computed is summed with zeros from the others.

    One buffer, so that every rank joins the same collectives whatever its micro-batches gave: a rank with
    no micro-batch in an epoch's last step, or none with a counted term, has no gradients at all, and a
    collective per parameter that is not ``None`` would then pair one rank's gradient with another's
    scalar (gloo: "Received data size doesn't match expected size"; NCCL: a hang)."""
    if world == 1 or not params:
        return
    device = params[0].device
    present = torch.tensor([float(p.grad is not None) for p in params], device=device)  # [P]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
    buffer = torch.cat([flat, present])
    dist.all_reduce(buffer)
    flat, present = buffer[: flat.numel()], buffer[flat.numel() :]
    offset = 0
    for p, computed in zip(params, present.tolist(), strict=True):
        grad = flat[offset : offset + p.numel()]
        offset += p.numel()
        p.grad = grad.view_as(p).to(p.dtype) if computed > 0 else None
