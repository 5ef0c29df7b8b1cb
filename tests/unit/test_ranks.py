"""``all_reduce_grads`` over 2 gloo processes: the same collectives on every rank whatever its micro-batches
gave, and the gradients one process would have had. Before it, the trainer all-reduced each gradient that
was not None, so a rank with no micro-batch in an epoch's last step (a reshuffled epoch packs into fewer
micro-batches than epoch 0) joined different collectives than the others: gloo aborted with "Received data
size doesn't match expected size" (found by ``tests/e2e/test_train_stream.py``'s torchrun run)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from eagle3.draft_trainer.ranks import all_reduce_grads


def _params(rank: int) -> list[torch.Tensor]:
    shapes = [(3, 4), (5,), (2, 2)]
    params = [torch.zeros(shape, requires_grad=True) for shape in shapes]
    if rank == 0:  # rank 0 computed the first two gradients; rank 1 none at all (no micro-batch this step)
        params[0].grad = torch.arange(12.0).view(3, 4)
        params[1].grad = torch.full((5,), 2.0)
    return params


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        params = _params(rank)
        all_reduce_grads(params, 2)
        dist.barrier()
        torch.save([p.grad for p in params], Path(out_dir) / f"grads-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_rank_without_gradients_joins_the_same_collective(tmp_path: Path) -> None:
    spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        grads = torch.load(tmp_path / f"grads-{rank}.pt")
        assert torch.equal(grads[0], torch.arange(12.0).view(3, 4))  # summed with the other rank's zeros
        assert torch.equal(grads[1], torch.full((5,), 2.0))
        assert grads[2] is None  # no rank computed it: stays None, as in one process (AdamW skips it)


def test_one_process_is_left_alone() -> None:
    params = _params(0)
    before = [None if p.grad is None else p.grad.clone() for p in params]
    all_reduce_grads(params, 1)
    for p, grad in zip(params, before, strict=True):
        if grad is None:
            assert p.grad is None
        else:
            assert p.grad is not None and torch.equal(p.grad, grad)
