"""The per-worker training loop: torch only, no Ray. It reads top to bottom.

``raytrain.worker.ray_entry.train_loop_per_worker`` (what Ray Train calls) reads the rank once
and hands everything to ``run_worker``; under ``torchrun`` or in one plain process (the face
``raytrain/loop.py``: ``python -m raytrain.loop --help``) the very same step runs, so a GPU can
be timed without Ray.
"""

from __future__ import annotations

import contextlib
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
from raytrain.data import Augment, InMemory, load_dataset
from raytrain.files import EVENTS_FILE, append_jsonl
from raytrain.models import build_model
from raytrain.worker.recipe import Mixer, make_ema, with_warmup

BAD_CHECK_EVERY = 20  # steps between the ranks' agreement on a bad image (one tiny all-reduce)


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
               resume: dict[str, Any] | None = None, source=None) -> None:
    """Train ``cfg`` on this worker's shards; report every epoch (all workers must call).

    ``source``: where batches come from (``raytrain.data.sources.Streamed`` for streamed
    images, given by the Ray entry point); default: the built-in dataset, whole in memory."""
    device, o = worker.device, cfg.optim
    startup = {"process": process_started_at(), "loop": time.time()}  # -> time to first step
    torch.manual_seed(cfg.run.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if source is None:
        source = InMemory(load_dataset(cfg.data.dataset, cfg.data.data_dir,
                                       cfg.data.synthetic_size).to(device))
    startup["data"] = time.time()
    model = build_model(cfg.model.model, source.num_classes, cfg.model.pretrained,
                        cfg.model.stem, cfg.data.image_size)
    ddp = prepare_model(model, worker, compile=cfg.model.compile)
    startup["model"] = time.time()
    amp_dtype = autocast_dtype(o.precision, device)
    # The global batch is split over the workers actually running (elastic runs may have
    # fewer than --num-workers' maximum).
    batch = max(1, o.batch_size // worker.world)
    micro = max(1, batch // o.grad_accum)  # the per-step batch; one update per grad_accum
    steps = source.steps(worker.world, micro)
    updates = -(-steps // o.grad_accum)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg, updates * o.epochs, updates * o.warmup_epochs)
    ema = make_ema(model, o.ema)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    augment = cfg.data.augment if cfg.data.augment is not None else cfg.data.dataset != "synthetic"
    aug = Augment(*source.normalization(cfg.data.normalize), device,
                  crop_pad=source.crop_pad if augment else 0,
                  flip=augment and source.flip_ok, channels_last=True)
    done, step = 0, 0
    if resume is not None:
        done, step = checkpoint.restore(resume, model, optimizer, scheduler, scaler, ema)
    for epoch in range(done + 1, o.epochs + 1):
        train = train_epoch(ddp, source, aug, optimizer, scheduler, scaler, amp_dtype, worker,
                            cfg, epoch, steps, micro, ema)
        step += steps
        # The average is evaluated beside the raw weights, in the same pass over the test split
        # (streamed: one decode of the val images per epoch, not two).
        eval_start = time.perf_counter()
        test = evaluate(model, source, aug, amp_dtype, worker, batch,
                        also=[ema.module] if ema is not None else ())
        metrics = epoch_metrics(epoch, train, test, optimizer, cfg.data.skip_bad_images)
        metrics["eval_s"] = time.perf_counter() - eval_start
        if ema is not None:
            ema_test = test["also"][0]
            metrics.update(test_loss_ema=ema_test[0] / max(ema_test[2], 1),
                           test_acc_ema=ema_test[1] / max(ema_test[2], 1))
        if not cfg.data.streaming:  # in memory: no waiting for data to speak of
            metrics.pop("data_wait")
        if epoch == done + 1:  # first epoch of this attempt: when it started, from where
            metrics.update(first_step_at=train["first_step_at"], resumed_from=done,
                           startup=startup)
        if cfg.data.streaming:  # every epoch is a new Ray Data pass: its start, each time
            metrics["first_batch_s"] = train["first_batch_s"]
        # Never checkpoint a diverged model: the latest checkpoint is what a rerun resumes.
        save = worker.master and "error" not in metrics and (
            epoch % cfg.run.checkpoint_every == 0 or epoch == o.epochs)
        state = checkpoint.training_state(model, optimizer, scheduler, scaler, epoch, step,
                                          cfg.to_flat(), ema, metrics) if save else None
        report(metrics, state)
        if "error" in metrics:
            return


# ---------------------------------------------------------------------------- setup


def rss_mb() -> float:
    """This process's resident memory now, in MiB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (Linux: ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int,
                   warmup_steps: int = 0):
    """Stepped once per optimizer update; ``warmup_steps`` of linear warmup first."""
    kind = cfg.optim.lr_schedule
    steps = max(1, total_steps - warmup_steps)
    if kind == "cosine":
        main = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    elif kind == "onecycle":
        main = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.optim.lr,
                                                   total_steps=steps)
    else:
        main = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    return with_warmup(optimizer, main, warmup_steps)


# ---------------------------------------------------------------------------- epochs


def train_epoch(ddp: nn.Module, source, aug: Augment, optimizer, scheduler, scaler,
                amp_dtype, worker: Worker, cfg: TrainConfig, epoch: int, steps: int, batch: int,
                ema=None) -> dict[str, Any]:
    """One pass over this worker's shard (``steps`` batches of ``batch``, an optimizer update
    every --grad-accum of them); returns globally summed loss/correct/count.

    With mixup/cutmix a batch counts as ``lam`` correct where the prediction is the first
    label and ``1 - lam`` where it is the second: train_acc stays the share of the mixed
    targets the network predicts."""
    device, o = worker.device, cfg.optim
    mix = Mixer(o.mixup, o.cutmix, cfg.run.seed, epoch, worker.rank)
    ddp.train()
    gen = torch.Generator(device=device).manual_seed(
        (cfg.run.seed * 1_000_003 + epoch) * 4099 + worker.rank)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss*n, correct, n, wait, bad
    count = 0
    first_bad = torch.tensor(steps + 1, device=device)  # 1-based step of the first NaN loss
    first_step_at = first_batch_s = rss_start = 0.0
    skip = cfg.optim.nan_policy == "skip"
    bad = BadImages(cfg, worker, epoch)
    progress = Progress(cfg, worker, epoch, steps, batch)
    _sync(device)
    # The ranks leave the last epoch's evaluation and report at different times; the first
    # gradient all-reduce would absorb the skew into this epoch's clock (up to ~10% of a
    # 0.5 s epoch here). Waiting for each other first keeps images_per_s a training figure.
    all_reduce(torch.zeros(1, device=device))
    start, started_at = time.perf_counter(), time.time()
    batches = iter(source.train_batches(epoch, worker.rank, worker.world, cfg.run.seed, steps,
                                        batch))
    wait = 0.0
    i = 0
    while True:
        fetch = time.perf_counter()
        item = next(batches, None)  # a streamed batch may not be there yet: waiting for data
        wait += time.perf_counter() - fetch
        if item is None:
            break
        x, y = bad.drop(*item)
        if i == 0:
            first_batch_s = time.perf_counter() - start
        x, y, y_b, lam = mix(aug(x, gen), y)
        update = (i + 1) % o.grad_accum == 0 or i + 1 == steps
        loss, correct, finite = train_step(
            ddp, x, y, optimizer, scaler, amp_dtype, skip, y_b=y_b, lam=lam,
            smoothing=o.label_smoothing, clip=o.clip_grad, accum=o.grad_accum,
            update=update, zero=i % o.grad_accum == 0)
        if update:
            scheduler.step()
            if ema is not None:
                ema.update_parameters(_unwrapped(ddp))
        # Sums stay on the device (no per-step sync); the count is plain Python.
        sums[:2] += torch.stack([loss.detach().double() * len(y), correct.double()])
        count += len(y)
        if not skip:  # --nan-policy skip: train_step skipped a non-finite step; go on
            first_bad = torch.where(finite, first_bad, torch.clamp(first_bad, max=i + 1))
        if worker.master and cfg.run.log_every and i % cfg.run.log_every == 0:
            log_line(cfg, seed_log_line(epoch, i, len(y), source.shard_size(worker.rank,
                                                                            worker.world),
                                        steps, loss.item()))
        if i == 0:
            _sync(device)
            first_step_at = time.time()
            rss_start = rss_mb()
        i += 1
        progress.step(i, count, wait)
        if i % BAD_CHECK_EVERY == 0 and bad.stop_now():
            break
    _sync(device)
    seconds = time.perf_counter() - start
    sums[2], sums[3], sums[4] = count, wait, len(bad.seen)
    all_reduce(sums)
    all_reduce(first_bad, op=dist.ReduceOp.MIN)
    bad_stop = bad.stop_now()
    first = int(first_bad.item())
    rss = torch.tensor([peak_rss_mb(), rss_mb() - rss_start if i else 0.0], device=device)
    all_reduce(rss, op=dist.ReduceOp.MAX)
    return {"sums": sums.tolist(), "seconds": seconds, "steps": steps, "world": worker.world,
            "first_bad_step": first if first <= steps else None, "first_step_at": first_step_at,
            "first_batch_s": first_batch_s, "bad_image": bad_stop, "rss_mb": rss[0].item(),
            "started_at": started_at,
            "rss_growth_mb": rss[1].item()}


class BadImages:
    """Streamed images that could not be decoded: their rows are dropped from the batch (a
    batch with nothing else keeps its zero rows), and each is an ``events.jsonl`` entry. With
    --skip-bad-images that is all; without it the ranks agree every BAD_CHECK_EVERY steps (and
    at the end of the epoch) whether any met one, and then all stop together - one rank
    leaving alone would hang the others in DDP's all-reduce."""

    def __init__(self, cfg: TrainConfig, worker: Worker, epoch: int):
        self.cfg, self.worker, self.epoch = cfg, worker, epoch
        self.seen: list[str] = []

    def drop(self, x: torch.Tensor, y: torch.Tensor, bad: list) -> tuple[torch.Tensor, ...]:
        if not bad:
            return x, y
        rows = [r for r, _ in bad]
        for _, name in bad:
            self.seen.append(name)
            event(self.cfg, {"event": "bad_image", "epoch": self.epoch, "image": name,
                             "rank": self.worker.rank, "skipped": self.cfg.data.skip_bad_images})
        keep = torch.ones(len(y), dtype=torch.bool)
        keep[rows] = False
        if not keep.any():
            return x, y
        keep = keep.to(y.device)
        return x[keep], y[keep]

    def stop_now(self) -> str | None:
        """Collective: the first bad image any rank met, when the run must stop; else None."""
        if self.cfg.data.skip_bad_images:
            return None
        flag = torch.tensor([1.0 if self.seen else 0.0], device=self.worker.device)
        all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return None
        names = gather_objects(self.seen[:1])
        return next(n for found in names for n in found)


class Progress:
    """Rank 0's in-epoch progress line every --progress-every seconds (streamed data only:
    a built-in epoch takes seconds): images/s, ETA, the share of time spent waiting on data."""

    def __init__(self, cfg: TrainConfig, worker: Worker, epoch: int, steps: int, batch: int):
        every = cfg.data.progress_every if cfg.data.streaming and worker.master else 0
        self.cfg, self.epoch, self.steps, self.world = cfg, epoch, steps, worker.world
        self.every = every
        self.start = self.last = time.perf_counter()

    def step(self, i: int, count: int, wait: float) -> None:
        now = time.perf_counter()
        if not self.every or now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        rate = count * self.world / elapsed  # ranks run the same steps at the same pace
        eta = elapsed / i * (self.steps - i)
        log_line(self.cfg, f"epoch {self.epoch}: step {i}/{self.steps}, {rate:,.0f} images/s, "
                           f"ETA {eta:.0f}s, waiting for data {100 * wait / elapsed:.0f}%")


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer, scaler,
               amp_dtype, skip_nonfinite: bool, *, y_b: torch.Tensor | None = None,
               lam: float = 1.0, smoothing: float = 0.0, clip: float = 0.0, accum: int = 1,
               update: bool = True, zero: bool = True):
    """Forward, backward and (``update``) the optimizer step. Returns (mean loss, correct
    count, loss finite) tensors. ``y_b``/``lam``: mixed targets; ``accum``: the gradient is
    accumulated over that many calls, the first with ``zero``, the last with ``update``
    (before it DDP's ``no_sync`` skips the all-reduce)."""
    sync = getattr(model, "no_sync", None) if not update else None
    with sync() if sync is not None else contextlib.nullcontext():
        with torch.autocast(x.device.type, dtype=amp_dtype or torch.float32,
                            enabled=amp_dtype is not None):
            logits = model(x)
        loss = _loss(logits.float(), y, smoothing)
        if y_b is not None and lam < 1.0:
            loss = lam * loss + (1 - lam) * _loss(logits.float(), y_b, smoothing)
        if zero:
            optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss / accum if accum > 1 else loss).backward()
    finite = torch.isfinite(loss)
    pred = logits.argmax(1)
    correct = (pred == y).sum() if y_b is None or lam >= 1.0 else \
        lam * (pred == y).sum() + (1 - lam) * (pred == y_b).sum()
    if not update:
        return loss, correct, finite
    if skip_nonfinite or clip:
        scaler.unscale_(optimizer)
        norm = nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)
        if skip_nonfinite and not torch.isfinite(norm):  # DDP averaged the gradients: a NaN
            optimizer.zero_grad(set_to_none=True)        # anywhere is a NaN everywhere
            scaler.update()
            return loss, correct, finite
    scaler.step(optimizer)
    scaler.update()
    return loss, correct, finite


def _loss(logits: torch.Tensor, y: torch.Tensor, smoothing: float) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="sum", label_smoothing=smoothing) / \
        max(len(y), 1)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside torch.compile's and DDP's wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


@torch.no_grad()
@torch.no_grad()  # digits: 0.06 s of a 0.73 s epoch with autograd recording (issue #27)
def evaluate(model: nn.Module, source, aug: Augment, amp_dtype, worker: Worker, batch: int,
             also: list[nn.Module] | tuple = ()) -> dict[str, Any]:
    """Loss and accuracy over the whole test split, each sample on exactly one worker.

    Uses the unwrapped model: DDP's forward would add collectives that uneven shards break.
    Images that could not be decoded are left out, and named. ``also``: more models
    evaluated on the same batches; their (loss sum, correct, n) are in ``"also"``.
    """
    models = [model, *also]
    for m in models:
        m.eval()
    # per model: loss, correct, n; then the count of bad images
    sums = torch.zeros(3 * len(models) + 1, dtype=torch.float64, device=worker.device)
    seen: list[str] = []
    for x, y, bad in source.test_batches(worker.rank, worker.world, batch):
        x, y = x.to(worker.device, non_blocking=True), y.to(worker.device, non_blocking=True)
        if bad:
            keep = torch.ones(len(y), dtype=torch.bool)
            keep[[r for r, _ in bad]] = False
            seen += [name for _, name in bad]
            x, y = x[keep.to(x.device)], y[keep.to(y.device)]
            if not len(y):
                continue
        x = aug(x)
        for i, m in enumerate(models):
            with torch.autocast(worker.device.type, dtype=amp_dtype or torch.float32,
                                enabled=amp_dtype is not None):
                logits = m(x)
            sums[3 * i:3 * i + 3] += torch.stack([
                F.cross_entropy(logits.float(), y, reduction="sum").double(),
                (logits.argmax(1) == y).sum().double(),
                torch.tensor(float(len(y)), dtype=torch.float64, device=y.device)])
    sums[-1] = len(seen)
    all_reduce(sums)
    for m in models:
        m.train()
    first_bad = None
    if sums[-1].item():
        first_bad = next(n for found in gather_objects(seen[:1]) for n in found)
    totals = sums.tolist()
    return {"sums": totals[:3] + totals[-1:], "bad_image": first_bad,
            "also": [totals[3 * i:3 * i + 3] for i in range(1, len(models))]}


def epoch_metrics(epoch: int, train: dict[str, Any], test: dict[str, Any], optimizer,
                  skip_bad: bool = False) -> dict[str, Any]:
    """The per-epoch metrics every worker reports (identical on all: they are all-reduced)."""
    loss_sum, correct, n, wait, bad = train["sums"]
    t_loss, t_correct, t_n, t_bad = test["sums"]
    metrics = {
        "epoch": epoch,
        "train_loss": loss_sum / max(n, 1),
        "train_acc": correct / max(n, 1),
        "test_loss": t_loss / max(t_n, 1),
        "test_acc": t_correct / max(t_n, 1),
        "lr": optimizer.param_groups[0]["lr"],
        "images_per_s": n / max(train["seconds"], 1e-9),
        "epoch_s": train["seconds"],
        # when this rank's epoch began: the gap to the next one, less epoch_s, is what an
        # epoch costs besides training (evaluation, checkpoint, report)
        "started_at": train["started_at"],
        "test_count": int(t_n),
        "train_count": int(n),
        "workers": train["world"],  # the world size that trained it (elastic runs vary)
        # the share of the epoch the ranks spent waiting for their next batch (mean over ranks)
        "data_wait": wait / train["world"] / max(train["seconds"], 1e-9),
        "worker_rss_mb": train["rss_mb"],  # the largest worker's peak resident memory so far
        # how much a worker's resident memory grew from its first step to the epoch's end
        "worker_rss_growth_mb": train["rss_growth_mb"],
    }
    if bad or t_bad:
        metrics["bad_images"] = int(bad + t_bad)
    if train["first_bad_step"] is not None:
        metrics["error"] = (f"loss became NaN/inf at epoch {epoch}, step "
                            f"{train['first_bad_step']} of {train['steps']}; lower --lr "
                            "or use --nan-policy skip")
    bad_image = train["bad_image"] or (test["bad_image"] if not skip_bad else None)
    if bad_image:
        metrics["error"] = (f"cannot decode image {bad_image} in epoch {epoch}; fix or "
                            "remove it, or pass --skip-bad-images to skip such images")
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
    event(cfg, {"event": "log", "text": text}, text)


def event(cfg: TrainConfig, record: dict[str, Any], fallback: str | None = None) -> None:
    """One entry of the run's events.jsonl; ``fallback`` printed where it cannot be written (a
    node that does not see the run directory, a full disk: not worth failing the run)."""
    if os.path.isdir(cfg.run_dir):
        try:
            append_jsonl(os.path.join(cfg.run_dir, EVENTS_FILE), record)
            return
        except OSError:
            pass
    if fallback is not None:
        print(fallback, flush=True)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective: all ranks call it); ``[obj]`` in one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def all_reduce(tensor: torch.Tensor, op=None) -> None:
    """In-place sum (or ``op``) across workers; a no-op in a single process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
