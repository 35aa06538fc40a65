"""What Ray Train runs on every worker: read the context once, resume, run the loop, report.

    TorchTrainer(train_loop_per_worker, train_loop_config=cfg.to_flat(), ...)

The loop itself (``raytrain.worker.loop``) knows nothing of Ray; this module gives it a rank,
a device, a checkpoint to resume from and a ``report`` that sets the Prometheus gauges and
hands each epoch (and rank 0's checkpoint) to Ray Train.

torch, the loop and the checkpoint format are imported where they run (on the workers, which
have them from their start: worker/warm.py): the driver and a Tune trial's process import this
module to hand its entry point to Ray Train, and a trial process needs torch for nothing else.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from raytrain import ray_compat
from raytrain.config import TrainConfig


def train_loop_per_worker(config: dict[str, Any], start_dir: str | None = None) -> None:
    """Ray Train's entry point: read the context once, then run the loop.

    ``start_dir``: a training state to start from when this run has no checkpoint of its own
    yet (a PBT trial started from another trial's state, ``raytrain.tune.pbt.StartFrom``)."""
    import ray.train
    import ray.train.torch
    import torch

    from raytrain import checkpoint
    from raytrain.worker.loop import Worker, run_worker

    threads = os.environ.get("OMP_NUM_THREADS", "")  # Ray's, for this worker's CPUs
    if threads.isdigit() and torch.get_num_threads() != int(threads):
        # A process that imported torch before Ray set it (RAY_preload_python_modules):
        # 2 threads per 1-CPU worker ran digits epochs 3x slower on 2 cores (1.8 s, not 0.6).
        torch.set_num_threads(int(threads))
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

    reports = EpochReports(cfg.run.storage_path, worker.world, ckpt, cfg.optim.epochs)

    def report(metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        gauges.set(metrics)
        reports(metrics, state)

    source = None
    if stream is not None:  # every rank asks for its shards (a barrier in Ray Train)
        from raytrain.data.sources import Streamed

        source = Streamed(ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("val"),
                          stream["num_classes"], stream["n_train"], stream["n_val"],
                          cfg.data.image_size, worker.device, cfg.data.decode == "worker",
                          cfg.run.seed, cfg.data.augment is not False)
    run_worker(cfg, worker, report, resume, source)
    reports.wait()  # the last epoch reported before the train function returns


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


class EpochReports:
    """Each epoch to Ray Train, rank 0's checkpoint with it, off the training path.

    ``__call__`` returns at once: a thread saves rank 0's checkpoint and calls
    ``ray.train.report`` while the next epoch trains (Ray's own report waits for its barrier
    and for the controller to take the result, and the save wrote and copied a checkpoint:
    ~0.05-0.1 s of a 0.8 s digits epoch, issue #27). At most one epoch is in flight: the next
    call first waits for it, so a slow store holds training back rather than piling up states.

    A checkpoint that cannot be saved (full disk, failing storage) stops the run the way a NaN
    loss does: that epoch is reported with an "error" (its row is the run's last), no later
    epoch is reported, and every rank returns at its next epoch's end. Rank 0 saves the
    checkpoint itself, before report(), and hands the outcome to every rank (Ray's
    broadcast_from_rank_zero, in the same thread on every rank, so in the same order as the
    report barriers): inside report() the copy runs after the ranks' barrier and raises on
    rank 0 alone (Ray 2.60): a partial checkpoint directory is left, the worker group is
    restarted --max-failures times to fail the same way, and rank 0 cannot report again.
    Ray's own ``CheckpointUploadMode.ASYNC`` raises such a failure into the training thread:
    the same restarts.
    """

    def __init__(self, storage_path: str, world: int, started_from=None, epochs: int = 0):
        from concurrent.futures import ThreadPoolExecutor

        self.storage_path, self.world, self.started_from = storage_path, world, started_from
        self.epochs = epochs  # the last epoch's checkpoint carries model.pt (the run's export)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="raytrain-report")
        self.pending = None  # the epoch in flight (a Future)
        self.failed: str | None = None  # a checkpoint save's error, known to every rank

    def __call__(self, metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        self.wait()
        if self.failed is not None:  # an earlier epoch's save failed and was reported so
            metrics["error"] = self.failed  # run_worker stops; this epoch is not reported
            return
        from raytrain import checkpoint

        blob = export = None
        if state is not None:  # taken now: training goes on changing the tensors
            blob = checkpoint.serialize(state)
            if metrics["epoch"] == self.epochs:  # the driver copies it: it imports no torch
                export = checkpoint.serialize(checkpoint.model_weights_of(state, "the state"))
        self.pending = self.pool.submit(self._report, dict(metrics), blob, export)

    def wait(self) -> None:
        """Until the epoch in flight is reported (its exception, if any, raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _report(self, metrics: dict[str, Any], blob: bytes | None, export: bytes | None
                ) -> None:
        import ray.train
        from ray.train.collective import broadcast_from_rank_zero

        name = f"checkpoint_epoch_{metrics['epoch']:04d}"
        saved = error = None
        if blob is not None:
            saved, error = _save_checkpoint(blob, name, metrics["epoch"], self.storage_path,
                                            self.started_from, export)
        if self.world > 1:  # every rank calls it: rank 0's outcome, to all
            error = broadcast_from_rank_zero(error)
        if error is not None:
            metrics["error"] = self.failed = error
        ray.train.report(metrics, checkpoint=saved, checkpoint_dir_name=name,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)


def _save_checkpoint(blob: bytes, name: str, epoch: int, storage_path: str, started_from=None,
                     export: bytes | None = None):
    """Rank 0: a ``checkpoint.serialize``d state into the run's storage as checkpoint ``name``.
    Returns (checkpoint, None), or (None, a one-line error) with no partial directory left and
    earlier ones as they were."""
    import ray.train

    from raytrain import checkpoint

    # The very copy (pyarrow: local path, NFS, s3://, gs://) that report() makes of a
    # checkpoint it is given; see ray_compat.CheckpointStorage.
    storage = ray_compat.CheckpointStorage()
    target = storage.path_of(name)
    for attempt in range(3):
        try:
            with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as directory:
                checkpoint.save(blob, directory, export)
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
