"""The per-worker training loop: torch only, no Ray. It reads top to bottom.

``raytrain.worker.ray_entry.train_loop_per_worker`` (what Ray Train calls) reads the rank once
and hands everything to ``run_worker``; under ``torchrun`` or in one plain process
(``raytrain.worker.local``, ``python -m raytrain.loop --help``) the very same step runs, so a
GPU can be timed without Ray.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raytrain import checkpoint
from raytrain.config import TrainConfig
from raytrain.data import Augment, Dataset, batches, epoch_shard, eval_shard, load_dataset, \
    steps_per_epoch
from raytrain.files import EVENTS_FILE, append_jsonl
from raytrain.models import build_model

EVAL_BATCH = 1024


@dataclass(frozen=True)
class Worker:
    """Who this process is. Read once, at the top of the worker function."""

    rank: int
    local_rank: int
    world: int
    device: torch.device

    @property
    def master(self) -> bool:
        """Rank 0 alone saves checkpoints and prints batch lines."""
        return self.rank == 0


# (metrics, training state or None) -> None; the state is given on rank 0 only.
Reporter = Callable[[dict[str, Any], "dict[str, Any] | None"], None]


def run_worker(cfg: TrainConfig, worker: Worker, report: Reporter,
               resume: dict[str, Any] | None = None) -> None:
    """Train ``cfg`` on this worker's shards; report every epoch (all workers must call)."""
    device, o = worker.device, cfg.optim
    startup = {"process": process_started_at(), "loop": time.time()}  # -> time to first step
    torch.manual_seed(cfg.run.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    data = load_dataset(cfg.data.dataset, cfg.data.data_dir, cfg.data.synthetic_size).to(device)
    startup["data"] = time.time()
    model = build_model(cfg.model.model, data.num_classes, cfg.model.pretrained, cfg.model.stem)
    ddp = prepare_model(model, worker, compile=cfg.model.compile)
    startup["model"] = time.time()
    amp_dtype = autocast_dtype(o.precision, device)
    # The global batch is split over the workers actually running (elastic runs may have
    # fewer than --num-workers' maximum).
    steps = steps_per_epoch(len(data.train_y), worker.world, max(1, o.batch_size // worker.world))
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg, steps * o.epochs)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    augment = cfg.data.augment if cfg.data.augment is not None else cfg.data.dataset != "synthetic"
    aug = Augment(*data.normalization(cfg.data.normalize), device, crop_pad=4 if augment else 0,
                  flip=augment and data.flip_ok, channels_last=True)
    done, step = 0, 0
    if resume is not None:
        done, step = checkpoint.restore(resume, model, optimizer, scheduler, scaler)
    for epoch in range(done + 1, o.epochs + 1):
        train = train_epoch(ddp, data, aug, optimizer, scheduler, scaler, amp_dtype, worker,
                            cfg, epoch, steps)
        step += steps
        test = evaluate(model, data, aug, amp_dtype, worker)
        metrics = epoch_metrics(epoch, train, test, optimizer)
        if epoch == done + 1:  # first epoch of this attempt: when it started, from where
            metrics.update(first_step_at=train["first_step_at"], resumed_from=done,
                           startup=startup)
        # Never checkpoint a diverged model: the latest checkpoint is what a rerun resumes.
        save = worker.master and "error" not in metrics and (
            epoch % cfg.run.checkpoint_every == 0 or epoch == o.epochs)
        state = checkpoint.training_state(model, optimizer, scheduler, scaler, epoch, step,
                                          cfg.to_flat()) if save else None
        report(metrics, state)
        if "error" in metrics:
            return


# ---------------------------------------------------------------------------- setup


def process_started_at() -> float | None:
    """When this process started, in epoch seconds (Linux: /proc, to 10 ms); else None."""
    try:
        with open("/proc/self/stat") as f:  # field 22: start time in ticks after boot
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def prepare_model(model: nn.Module, worker: Worker, compile: bool = False) -> nn.Module:
    """The one place a model meets distribution: device, memory format, DDP, compile."""
    # channels_last on CPUs too: oneDNN's convolutions run NHWC faster (1 thread, batch 64,
    # forward + backward + SGD: seed-cnn 5,000 -> 7,300 images/s, small-cnn 156 -> 206,
    # resnet18 even). Its images come from Augment in the same format.
    model.to(worker.device, memory_format=torch.channels_last)
    wrapped = model
    if worker.world > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[worker.device] if worker.device.type == "cuda" else None,
            gradient_as_bucket_view=True)  # grads live in the all-reduce buckets: no copy
    return torch.compile(wrapped) if compile else wrapped


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """None means full fp32 (no autocast)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.momentum, 0.999),
                                 weight_decay=o.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                           weight_decay=o.weight_decay, nesterov=o.momentum > 0)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """Stepped once per batch."""
    kind = cfg.optim.lr_schedule
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if kind == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.optim.lr,
                                                   total_steps=total_steps)
    return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)


# ---------------------------------------------------------------------------- epochs


def train_epoch(ddp: nn.Module, data: Dataset, aug: Augment, optimizer, scheduler, scaler,
                amp_dtype, worker: Worker, cfg: TrainConfig, epoch: int, steps: int
                ) -> dict[str, Any]:
    """One pass over this worker's shard; returns globally summed loss/correct/count."""
    device = worker.device
    ddp.train()
    shard = epoch_shard(len(data.train_y), worker.rank, worker.world, cfg.run.seed, epoch)
    gen = torch.Generator(device=device).manual_seed(
        (cfg.run.seed * 1_000_003 + epoch) * 4099 + worker.rank)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss*n, correct, n
    count = 0
    first_bad = torch.tensor(steps + 1, device=device)  # 1-based step of the first NaN loss
    first_step_at = 0.0
    skip = cfg.optim.nan_policy == "skip"
    _sync(device)
    # The ranks leave the last epoch's evaluation and report at different times; the first
    # gradient all-reduce would absorb the skew into this epoch's clock (up to ~10% of a
    # 0.5 s epoch here). Waiting for each other first keeps images_per_s a training figure.
    all_reduce(torch.zeros(1, device=device))
    start = time.perf_counter()
    for i, idx in enumerate(batches(shard.to(device), steps)):
        x, y = aug(data.train_x[idx], gen), data.train_y[idx]
        loss, correct, finite = train_step(ddp, x, y, optimizer, scaler, amp_dtype, skip)
        scheduler.step()
        # Sums stay on the device (no per-step sync); the count is plain Python.
        sums[:2] += torch.stack([loss.detach().double() * len(y), correct.double()])
        count += len(y)
        if not skip:  # --nan-policy skip: train_step skipped a non-finite step; go on
            first_bad = torch.where(finite, first_bad, torch.clamp(first_bad, max=i + 1))
        if worker.master and cfg.run.log_every and i % cfg.run.log_every == 0:
            log_line(cfg, seed_log_line(epoch, i, len(y), len(shard), steps, loss.item()))
        if i == 0:
            _sync(device)
            first_step_at = time.time()
    _sync(device)
    seconds = time.perf_counter() - start
    sums[2] = count
    all_reduce(sums)
    all_reduce(first_bad, op=dist.ReduceOp.MIN)
    bad = int(first_bad.item())
    return {"sums": sums.tolist(), "seconds": seconds, "steps": steps,
            "first_bad_step": bad if bad <= steps else None, "first_step_at": first_step_at}


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer, scaler,
               amp_dtype, skip_nonfinite: bool):
    """Forward, backward, update. Returns (mean loss, correct count, loss finite) tensors."""
    with torch.autocast(x.device.type, dtype=amp_dtype or torch.float32,
                        enabled=amp_dtype is not None):
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y, reduction="sum") / max(len(y), 1)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    finite = torch.isfinite(loss)
    if skip_nonfinite:  # DDP averaged the gradients: a NaN anywhere is a NaN everywhere
        scaler.unscale_(optimizer)
        norm = nn.utils.clip_grad_norm_(model.parameters(), math.inf)
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            scaler.update()
            return loss, (logits.argmax(1) == y).sum(), finite
    scaler.step(optimizer)
    scaler.update()
    return loss, (logits.argmax(1) == y).sum(), finite


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, aug: Augment, amp_dtype, worker: Worker
             ) -> list[float]:
    """Loss and accuracy over the whole test split, each sample on exactly one worker.

    Uses the unwrapped model: DDP's forward would add collectives that uneven shards break.
    """
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=worker.device)
    shard = eval_shard(len(data.test_y), worker.rank, worker.world).to(worker.device)
    for idx in shard.split(EVAL_BATCH):
        with torch.autocast(worker.device.type, dtype=amp_dtype or torch.float32,
                            enabled=amp_dtype is not None):
            logits = model(aug(data.test_x[idx]))
        y = data.test_y[idx]
        sums[:2] += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum").double(),
                                 (logits.argmax(1) == y).sum().double()])
    sums[2] = len(shard)
    all_reduce(sums)
    model.train()
    return sums.tolist()


def epoch_metrics(epoch: int, train: dict[str, Any], test: list[float], optimizer
                  ) -> dict[str, Any]:
    """The per-epoch metrics every worker reports (identical on all: they are all-reduced)."""
    loss_sum, correct, n = train["sums"]
    t_loss, t_correct, t_n = test
    metrics = {
        "epoch": epoch,
        "train_loss": loss_sum / max(n, 1),
        "train_acc": correct / max(n, 1),
        "test_loss": t_loss / max(t_n, 1),
        "test_acc": t_correct / max(t_n, 1),
        "lr": optimizer.param_groups[0]["lr"],
        "images_per_s": n / max(train["seconds"], 1e-9),
        "epoch_s": train["seconds"],
        "test_count": int(t_n),
        "train_count": int(n),
    }
    if train["first_bad_step"] is not None:
        metrics["error"] = (f"loss became NaN/inf at epoch {epoch}, step "
                            f"{train['first_bad_step']} of {train['steps']}; lower --lr "
                            "or use --nan-policy skip")
    return metrics


def seed_log_line(epoch: int, step: int, batch: int, shard: int, steps: int, loss: float
                  ) -> str:
    """The seed DDP script's progress line, in its own format: images this rank has seen of
    its shard (``len(train_sampler)``), the share of its steps done, the batch's loss. Only
    the epoch differs: it counts from 1, as raytrain's epoch lines do (the seed's from 0)."""
    return "Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
        epoch, step * batch, shard, 100.0 * step / steps, loss)


def log_line(cfg: TrainConfig, text: str) -> None:
    """A rank-0 progress line: to the run's events.jsonl, which the driver prints (Ray's own
    worker output is not forwarded unless --verbose), else to stdout."""
    if not os.path.isdir(cfg.run_dir):  # a node that does not see the run directory
        print(text, flush=True)
        return
    try:
        append_jsonl(os.path.join(cfg.run_dir, EVENTS_FILE), {"event": "log", "text": text})
    except OSError:  # a full disk: the line is not worth failing the run
        print(text, flush=True)


def all_reduce(tensor: torch.Tensor, op=None) -> None:
    """In-place sum (or ``op``) across workers; a no-op in a single process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
