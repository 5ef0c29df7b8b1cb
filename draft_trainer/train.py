"""The training loop: TTT loss, AdamW + warmup/cosine, exact resume, SIGTERM checkpoint, data parallel.

Data parallel: launched by ``torchrun`` (``WORLD_SIZE`` > 1) each rank reads its own micro-batches
of every global step (``draft_trainer/data.py``), the loss is normalised by the *global* number of
supervised terms (all-reduced), and the gradients are summed across ranks with ``all_reduce``
before clipping; so W ranks compute the same update as one process with ``grad_accum_steps = W``.

Resume: ``RUN/checkpoint.pt`` holds the model, optimizer, scheduler, RNG and the global step; the
data order is a function of (seed, epoch), so a resumed run continues the same loss curve.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagle3.core.progress import ProgressBar
from eagle3.draft_trainer.build import build_draft, lr_lambda
from eagle3.draft_trainer.checkpoint import (
    DRAFT_DIR,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    save_draft,
    set_rng_state,
    write_text_atomic,
)
from eagle3.draft_trainer.config import TrainConfig, resolve_device
from eagle3.draft_trainer.cpu_bf16 import warn_if_emulated
from eagle3.draft_trainer.errors import ConfigError, DataError
from eagle3.draft_trainer.ranks import all_reduce_grads, all_reduce_sum, any_rank, join_ranks
from eagle3.draft_trainer.rounds import RoundCounts, simulate_rounds
from eagle3.draft_trainer.stream_data import EpochReport, FeatureSource, training_data
from eagle3.draft_trainer.trackers import open_trackers, parse_log_to
from eagle3.draft_trainer.ttt import (
    PackedBatch,
    simulated_acceptance,
    step_counts,
    ttt_forward,
)
from eagle3.draft_trainer.ttt_loss import Objective

METRICS_FILE = "metrics.jsonl"


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    stopped_early: bool  # SIGTERM (checkpoint saved) before the planned end
    heldout: dict[str, Any] = field(default_factory=dict)
    train_s: float = 0.0


class _Stop:
    def __init__(self) -> None:
        self.requested = False

    def __call__(self, _signum: int, _frame: Any) -> None:
        self.requested = True


class Trainer:
    def __init__(self, cfg: TrainConfig, source: FeatureSource | None = None) -> None:
        if not cfg.model:
            raise ConfigError(
                "model is not set: give the verifier (--model, or the config key model) as a local Hugging Face "
                "checkpoint directory, an org/name in the local Hugging Face cache, or SmolLM2-135M-Instruct"
            )
        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        self.device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.autocast = cfg.autocast_bf16_cuda if self.device.type == "cuda" else cfg.autocast_bf16
        if self.autocast and self.device.type == "cpu":
            warn_if_emulated()  # an AVX2-only CPU emulates bf16: 30-50x slower than fp32 (cpu_bf16.py)
        self.rank, self.world = join_ranks(self.device)
        self.run_dir = Path(cfg.out)
        barrier = dist.barrier if self.world > 1 else None
        self.data = training_data(cfg, source, self.rank, self.world, barrier)  # a directory, or from servers
        meta = self.data.meta
        model, teacher = build_draft(cfg, meta.hidden_size, meta.aux_layer_ids)
        self.model, self.teacher = model.to(self.device), teacher.to(self.device)  # weights and d2t/t2d/embed
        self.model.resid_dropout.p = cfg.dropout
        self.model.train()  # dropout on while training; evaluate_heldout switches it off for its pass
        if cfg.freeze_lm_head:  # the verifier's head and final norm stay as initialised (config.py)
            self.model.lm_head.weight.requires_grad_(False)
            self.model.norm.weight.requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.micro_per_step = self.world * cfg.grad_accum_steps
        first = self.data.plan(
            self.data.split.train, cfg.max_batch_tokens, seed=cfg.seed, epoch=0, truncate=cfg.truncate
        )
        self.steps_per_epoch = len(first) // self.micro_per_step
        if self.steps_per_epoch == 0:
            raise DataError(
                f"{len(first)} micro-batches of {cfg.max_batch_tokens} tokens per epoch, fewer than the "
                f"{self.micro_per_step} one step needs (world size x grad_accum_steps)"
            )
        planned = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(planned, cfg.max_steps) if cfg.max_steps else planned
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_steps))
        self._plans: dict[int, list[list[int]]] = {0: first}
        # reader position -> ([n] bool teacher argmax in the draft vocab, [n] log teacher mass on it)
        self._in_vocab: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.objective = Objective(cfg.loss, cfg.lk_kl_scale, cfg.lk_kl_decay)
        self.step = 0

    def plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            self._plans = {
                epoch: self.data.plan(
                    self.data.split.train,
                    self.cfg.max_batch_tokens,
                    seed=self.cfg.seed,
                    epoch=epoch,
                    truncate=self.cfg.truncate,
                )
            }
        return self._plans[epoch]

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "rng": rng_state(self.device),
            "config": json.loads(self.cfg.to_json()),
        }

    def resume(self) -> bool:
        state = load_checkpoint(self.run_dir)  # CPU tensors; loading copies them to the model's device
        if state is None:
            return False
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.device)
        self.step = int(state["step"])
        return True

    def in_vocab(self, positions: list[int], batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] bool and [T] log mass (``Teacher.draft_vocab_stats``) for a packed batch, each sample's rows
        computed once (the teacher never changes)."""
        parts, row = [], 0
        for pos in positions:
            n = int((batch.seg_end[row] - batch.seg_start[row]).item())
            if pos not in self._in_vocab:
                self._in_vocab[pos] = self.teacher.draft_vocab_stats(batch.final[row : row + n], self.model.t2d)
            parts.append(self._in_vocab[pos])
            row += n
        return torch.cat([f for f, _ in parts]), torch.cat([m for _, m in parts])

    def my_micro_batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of ``step``. Packing a reshuffled epoch can give more micro-batches
        than epoch 0 (which fixed ``steps_per_epoch``): the epoch's last step takes all that remain, so
        no sample is dropped (fewer: its last step may have none, and updates nothing)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        last = index + 1 == self.steps_per_epoch
        group = self.plan(epoch)[index * self.micro_per_step : None if last else (index + 1) * self.micro_per_step]
        return group[self.rank :: self.world]

    def upcoming_micro_batches(self) -> Iterator[list[int]]:
        """This rank's micro-batches from the current step to the end (to the epoch's end where the data
        syncs at each epoch: ``SampleTable.syncs_each_epoch``), in the order ``train_step`` loads them."""
        end = self.total_steps
        if self.data.syncs_each_epoch:
            end = min(end, (self.step // self.steps_per_epoch + 1) * self.steps_per_epoch)
        for step in range(self.step, end):
            yield from self.my_micro_batches(step)

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        started = time.perf_counter()
        positions = self.my_micro_batches(self.step)
        device = self.device
        batches = [self.data.load_to(b, cfg.max_batch_tokens if cfg.truncate else None, device) for b in positions]
        data_s = time.perf_counter() - started
        counts = all_reduce_sum(
            sum((step_counts(b, cfg.ttt_steps) for b in batches), torch.zeros(cfg.ttt_steps, device=device)),
            self.world,
        )
        self.optimizer.zero_grad(set_to_none=True)
        stats = torch.zeros(4, cfg.ttt_steps, device=device)  # loss sums, correct, counted terms, acceptance
        loss_total = torch.zeros((), device=device)
        for batch, pos in zip(batches, positions, strict=True):
            in_vocab, log_mass = self.in_vocab(pos, batch)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
                result = ttt_forward(
                    self.model,
                    self.teacher,
                    batch,
                    cfg.ttt_steps,
                    cfg.step_decay,
                    counts,
                    in_vocab,
                    attention=cfg.attention,
                    teacher_log_mass=log_mass,
                    objective=self.objective,
                )
            # a micro-batch with no counted term (no supervised row whose teacher token is in the draft vocab: a
            # random verifier over a 129k vocabulary, a small batch) has a constant loss and no gradient
            if result.loss.requires_grad:
                result.loss.backward()  # type: ignore[no-untyped-call]
            loss_total += result.loss.detach()
            stats += torch.stack([result.loss_sums, result.correct, result.n_terms, result.accept_sums])
        all_reduce_grads(self.params, self.world)
        all_reduce_sum(loss_total, self.world)
        all_reduce_sum(stats, self.world)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        n_tokens = all_reduce_sum(torch.tensor(float(sum(b.n_tokens for b in batches)), device=device), self.world)
        acc = (stats[1] / stats[2].clamp(min=1)).tolist()
        return {
            "step": self.step,
            "loss": float(loss_total),
            "acc": acc,
            "sim_accept": simulated_acceptance(acc),
            "ce": (stats[0] / stats[2].clamp(min=1)).tolist(),
            "alpha": (stats[3] / stats[2].clamp(min=1)).tolist(),  # expected acceptance (ttt_loss.py)
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": int(n_tokens),
            "data_s": data_s,
            "step_s": time.perf_counter() - started,
        }

    @torch.no_grad()
    def evaluate_heldout(self) -> dict[str, Any]:
        """Per-step accuracy and simulated acceptance on the held-out samples, in eval mode (no dropout)."""
        self.model.eval()
        try:
            return self._evaluate_heldout()
        finally:
            self.model.train()

    def _evaluate_heldout(self) -> dict[str, Any]:
        cfg = self.cfg
        stats = torch.zeros(4, cfg.ttt_steps, device=self.device)  # CE, correct, terms, expected acceptance
        rounds = RoundCounts(cfg.ttt_steps)
        plan = self.data.plan(
            self.data.split.heldout, cfg.max_batch_tokens, seed=0, epoch=0, shuffle=False, truncate=True
        )
        for positions in plan[self.rank :: self.world]:
            batch = self.data.load_to(positions, cfg.max_batch_tokens, self.device)
            result = ttt_forward(self.model, self.teacher, batch, cfg.ttt_steps, attention=cfg.attention)
            stats += torch.stack([result.loss_sums, result.correct, result.n_terms, result.accept_sums])
            rounds.merge(
                simulate_rounds(
                    torch.stack(result.hits).cpu(), batch.loss_mask.cpu(), batch.seg_start.cpu(), batch.seg_end.cpu()
                )
            )
        all_reduce_sum(stats, self.world)
        round_sums = rounds.as_tensor().to(self.device)
        all_reduce_sum(round_sums, self.world)
        rounds = RoundCounts.from_tensor(round_sums.cpu())
        acc = (stats[1] / stats[2].clamp(min=1)).tolist()
        # heldout_tau: the online round walk replayed (draft_trainer.rounds), the figure to compare with
        # `eagle3 eval`'s tau; heldout_sim_accept multiplies per-token accuracies (an overestimate, kept for logs)
        return {
            "heldout_acc": acc,
            "heldout_sim_accept": simulated_acceptance(acc),
            "heldout_terms": stats[2].tolist(),
            "heldout_ce": (stats[0] / stats[2].clamp(min=1)).tolist(),
            "heldout_alpha": (stats[3] / stats[2].clamp(min=1)).tolist(),  # sum min(p, q): ttt_loss.py
            "heldout_tau": rounds.tau,
            "heldout_accepted_per_position": rounds.accepted_per_position,
            "heldout_rounds": rounds.rounds,
            "heldout_samples": len(self.data.split.heldout),
            "heldout_extra_replies_left_out": self.data.split.n_dropped,
        }


def _log(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def _progress(bar: ProgressBar, record: dict[str, Any], started: float, tokens: int, tau: float | None) -> None:
    elapsed_s = max(time.monotonic() - started, 1e-6)
    held = {"held_tau": f"{tau:.2f}"} if tau is not None else {}
    bar.set_postfix(
        loss=f"{record['loss']:.3f}", accept=f"{record['sim_accept']:.2f}", **held, tok_s=f"{tokens / elapsed_s:,.0f}"
    )
    bar.update(1)


def _epoch_evaluation_due(trainer: Trainer) -> bool:
    """The step just taken ended an epoch whose held-out evaluation is due (never the last step: the final
    evaluation follows it; never without held-out samples). The same on every rank (it is collective)."""
    every, step = trainer.cfg.eval_every_epochs, trainer.step
    if not every or step % trainer.steps_per_epoch or step >= trainer.total_steps:
        return False
    return (step // trainer.steps_per_epoch) % every == 0 and bool(trainer.data.split.heldout)


def train(cfg: TrainConfig, source: FeatureSource | None = None) -> RunResult:
    """Train (or resume) the run at ``cfg.out``; returns when done or after a SIGTERM checkpoint.
    ``source``: stream the features of ``cfg.prepared`` from servers (``draft_trainer/stream_data.py``)."""
    trainer = Trainer(cfg, source)
    run_dir, main = trainer.run_dir, trainer.rank == 0
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.json", cfg.to_json())
    resumed = trainer.resume()
    trainer.data.begin(trainer.upcoming_micro_batches())  # a stream prefetches them from here
    epoch_report = EpochReport(trainer.data.stats())
    metrics = run_dir / METRICS_FILE
    if main and resumed:
        _truncate_metrics(metrics, trainer.step)
    stop = _Stop()
    previous = signal.signal(signal.SIGTERM, stop) if _is_main_thread() else None
    started, tokens_seen, held_tau = time.monotonic(), 0, None
    bar = ProgressBar("train", trainer.total_steps, unit="step", initial=trainer.step, enabled=main and cfg.progress)
    names = parse_log_to(cfg.log_to) if main else ()
    trackers = open_trackers(names, run_dir, cfg.wandb_project, json.loads(cfg.to_json()))
    try:
        stopping = False
        while trainer.step < trainer.total_steps:
            stopping = any_rank(stop.requested, trainer.world, trainer.device)  # every rank stops at the same step
            if stopping:
                break
            record = trainer.train_step()
            tokens_seen += record["tokens"]
            epoch_report.add(record)
            evaluate_now = cfg.eval_every_steps and trainer.step % cfg.eval_every_steps == 0
            if evaluate_now:
                record.update(trainer.evaluate_heldout())
            if main and (trainer.step % cfg.log_every_steps == 0 or evaluate_now):
                _log(metrics, dict(record, epoch=(trainer.step - 1) // trainer.steps_per_epoch, time=time.time()))
                for tracker in trackers:
                    tracker.log(record, trainer.step)
            if _epoch_evaluation_due(trainer):  # simulated tau on the held-out split, every epoch
                held = trainer.evaluate_heldout()
                held_tau = held["heldout_tau"]
                if main:
                    epoch = trainer.step // trainer.steps_per_epoch - 1
                    _log(metrics, dict(held, step=trainer.step, epoch=epoch, epoch_end=True, time=time.time()))
                    for tracker in trackers:
                        tracker.log(held, trainer.step)
            if main and cfg.progress:
                _progress(bar, record, started, tokens_seen, held_tau)
            if main and trainer.step % trainer.steps_per_epoch == 0:  # the epoch's data wait, tokens/s, fetches
                _log(metrics, epoch_report.close(trainer.step, trainer.steps_per_epoch, trainer.data.stats()))
            if main and trainer.step % cfg.checkpoint_every_steps == 0:
                save_checkpoint(run_dir, trainer.state())
            epoch_ended = trainer.step % trainer.steps_per_epoch == 0 and trainer.step < trainer.total_steps
            if trainer.data.syncs_each_epoch and epoch_ended:  # a torchrun cache: every rank sees the others'
                trainer.data.epoch_sync()
                trainer.data.begin(trainer.upcoming_micro_batches())
        if main:
            save_checkpoint(run_dir, trainer.state())
            save_draft(trainer.model, run_dir / DRAFT_DIR)
        result = RunResult(run_dir, trainer.step, stopping, train_s=time.monotonic() - started)
        if not stopping:
            result.heldout = trainer.evaluate_heldout()
            if main:
                _log(metrics, dict(result.heldout, step=trainer.step, final=True, time=time.time()))
                for tracker in trackers:
                    tracker.log(result.heldout, trainer.step)
                write_text_atomic(run_dir / "heldout.json", json.dumps(result.heldout, indent=2) + "\n")
                _plot(run_dir)
    finally:
        trainer.data.close()
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for tracker in trackers:
            tracker.close()
    return result


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after the checkpoint (a kill after logging, before saving), so the curve is exact."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    write_text_atomic(path, "".join(line + "\n" for line in keep))


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _plot(run_dir: Path) -> None:
    from eagle3.draft_trainer.plot import plot_metrics  # Pillow: declared by eagle3[train]

    plot_metrics(run_dir / METRICS_FILE, run_dir / "training.png")
