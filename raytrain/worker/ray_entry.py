"""What Ray Train runs on every worker: read the context once, resume, run the loop, report.

    TorchTrainer(train_loop_per_worker, train_loop_config=cfg.to_flat(), ...)

The loop itself (``raytrain.worker.loop``) knows nothing of Ray; this module gives it a rank,
a device, a checkpoint to resume from and a ``report`` that sets the Prometheus gauges and
hands each epoch (and rank 0's checkpoint) to Ray Train.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from raytrain import checkpoint, ray_compat
from raytrain.config import TrainConfig
from raytrain.worker.loop import Worker, all_reduce, run_worker


def train_loop_per_worker(config: dict[str, Any], start_dir: str | None = None) -> None:
    """Ray Train's entry point: read the context once, then run the loop.

    ``start_dir``: a training state to start from when this run has no checkpoint of its own
    yet (a PBT trial started from another trial's state, ``raytrain.tune.pbt.StartFrom``)."""
    import ray.train
    import ray.train.torch

    config = dict(config)
    stream = config.pop("stream", None)  # streamed data: what the driver listed
    cfg = TrainConfig.from_flat(config)
    if not cfg.run.verbose:  # Ray Train logs every report at INFO on a logger named by path
        ray_compat.quiet_report_logs()
    ctx = ray.train.get_context()
    worker = Worker(ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_world_size(),
                    ray.train.torch.get_device())
    resume = None
    ckpt = ray.train.get_checkpoint()
    if ckpt is None and start_dir is not None:
        ckpt = ray.train.Checkpoint(start_dir)
    if ckpt is not None:
        with ckpt.as_directory() as directory:
            resume = checkpoint.load_state(directory)
    gauges = RayGauges(cfg.run.name, worker.rank)

    def report(metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        gauges.set(metrics)
        _ray_report(metrics, state, cfg.run.storage_path, worker.device, ckpt)

    source = None
    if stream is not None:  # every rank asks for its shards (a barrier in Ray Train)
        from raytrain.data.sources import Streamed

        source = Streamed(ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("val"),
                          stream["num_classes"], stream["n_train"], stream["n_val"],
                          cfg.data.image_size, worker.device, cfg.data.decode == "worker",
                          cfg.run.seed, cfg.data.augment is not False)
    run_worker(cfg, worker, report, resume, source)


class RayGauges:
    """raytrain_* metrics on Ray's Prometheus endpoint, tagged by run and worker rank."""

    NAMES = {"train_loss": "raytrain_train_loss", "train_acc": "raytrain_train_acc",
             "test_loss": "raytrain_test_loss", "test_acc": "raytrain_test_acc",
             "images_per_s": "raytrain_images_per_second", "epoch": "raytrain_epoch",
             "lr": "raytrain_lr"}

    def __init__(self, run: str, rank: int):
        from ray.util.metrics import Gauge

        self.tags = {"run": run, "rank": str(rank)}
        self.gauges = {key: Gauge(name, description=f"raytrain {key} per epoch",
                                  tag_keys=("run", "rank"))
                       for key, name in self.NAMES.items()}

    def set(self, metrics: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            gauge.set(float(metrics[key]), tags=self.tags)


def _ray_report(metrics: dict[str, Any], state: dict[str, Any] | None, storage_path: str,
                device: torch.device, started_from=None) -> None:
    """Report an epoch to Ray Train; rank 0, given ``state``, checkpoints it first.

    A checkpoint that cannot be saved (full disk, failing storage) stops the run the way a NaN
    loss does: every rank reports the epoch with an "error" and returns. So rank 0 copies the
    checkpoint itself, before report(), and shares the outcome (an all-reduce of one flag over
    the process group; Ray's broadcast_from_rank_zero is a round trip through an actor).
    Inside report() the copy runs after the ranks' barrier and raises on rank 0 alone (Ray
    2.60): a partial checkpoint directory is left, the worker group is restarted
    --max-failures times to fail the same way, and rank 0 cannot report again (report() would
    wait forever for the failed index).
    """
    import ray.train

    name = f"checkpoint_epoch_{metrics['epoch']:04d}"
    saved = error = None
    if state is not None:
        saved, error = _save_checkpoint(state, name, metrics["epoch"], storage_path,
                                        started_from)
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():  # run_worker stops on it; rank 0's metrics (the message) are recorded
        metrics["error"] = error or "checkpoint save failed on rank 0"
    ray.train.report(metrics, checkpoint=saved, checkpoint_dir_name=name,
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)


def _save_checkpoint(state: dict[str, Any], name: str, epoch: int, storage_path: str,
                     started_from=None):
    """Rank 0: ``state`` into the run's storage as checkpoint ``name``. Returns (checkpoint,
    None), or (None, a one-line error) with no partial directory left and earlier ones as
    they were."""
    import ray.train

    # The very copy (pyarrow: local path, NFS, s3://, gs://) that report() makes of a
    # checkpoint it is given; see ray_compat.CheckpointStorage.
    storage = ray_compat.CheckpointStorage()
    target = storage.path_of(name)
    for attempt in range(3):
        try:
            with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as directory:
                checkpoint.save(state, directory)
                return storage.persist(ray.train.Checkpoint.from_directory(directory),
                                       name), None
        except OSError as err:
            try:
                storage.delete(target)
            except OSError:  # nothing was created
                pass
            if "AWS Error" in str(err) and attempt < 2:  # S3 throttling: Ray's report()
                time.sleep(2 ** attempt)                 # retries it 3 times, so do we
                continue
            last = ray.train.get_checkpoint() or started_from  # the latest saved/resumed from
            base = os.path.basename(last.path.rstrip("/")) if last is not None else ""
            done = base.removeprefix("checkpoint_epoch_")
            kept = (f"the epoch {int(done)} checkpoint is intact" if done.isdigit() else
                    f"{base} is intact" if base else "no checkpoint was saved before it")
            return None, checkpoint.storage_failure(f"checkpoint save failed at epoch {epoch}",
                                                    err, storage_path, kept)
