"""The run directory and one training job: build Ray Train's TorchTrainer, run it, turn its
result into run files, exported weights and a summary.

    from raytrain.driver.run import fit
    summary = fit(cfg, started_at=time.time())   # on a connected cluster (driver.cluster)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import yaml

from raytrain import files, ray_compat, report, storage
from raytrain.config import FIELDS, TrainConfig
from raytrain.driver import console, tracking
from raytrain.driver.cluster import prestart_workers, train_env, worker_env
from raytrain.driver.nodes import NodeWatch
from raytrain.driver.preflight import Shape, check_storage_writable, preflight
from raytrain.errors import Interrupted, NoRoom, RaytrainError, TrainingError, short

# Settings that do not change what is trained: a run may be resumed with other values.
NOT_TRAINING = {"address", "verbose", "keep_cluster", "shared_storage", "compile", "max_failures",
                "wait_timeout", "log_every", "name", "storage_path", "keep_checkpoints",
                "use_gpu", "cpus_per_worker", "num_workers", "data_cpus", "decode",
                "skip_bad_images", "progress_every", "mlflow_uri", "mlflow_experiment"}


@dataclass
class Summary:
    run_dir: str
    rows: list[dict[str, Any]]
    wall_s: float
    first_step_s: float | None
    model_path: str | None
    startup: list[tuple[str, float]] | None = None  # the time to first step, by phase

    @property
    def final(self) -> dict[str, Any]:
        return self.rows[-1] if self.rows else {}


# ---------------------------------------------------------------------------- run dir

# A run on a bucket: raytrain's files, uploaded from the driver's mirror (raytrain/storage.py)
# after every epoch (EPOCH_FILES) and when the run ends (RUN_FILES; model.pt last: a run whose
# model.pt is in the bucket counts as finished).
EPOCH_FILES = (files.METRICS_FILE, "metrics.csv", files.EVENTS_FILE, "tensorboard")
RUN_FILES = ("config.yaml", "classes.json", "mlflow_run_id", *EPOCH_FILES, "learning_curves.png",
             "model.pt")


def upload_run_files(cfg: TrainConfig, names: tuple[str, ...] = RUN_FILES) -> None:
    """Copy ``names`` from the mirror to the run on the bucket (nothing for a local run);
    a storage.UploadError names the first file that failed."""
    if storage.is_uri(cfg.run_location):
        storage.upload(cfg.run_dir, cfg.run_location, names)


def _upload_quietly(cfg: TrainConfig) -> None:
    """On the way out of a failed or interrupted run: what can still be uploaded is (the
    failure being raised names what went wrong)."""
    try:
        upload_run_files(cfg)
    except OSError:
        pass


def saved_epochs(cfg: TrainConfig, resume: bool = False, fresh: bool = False) -> int:
    """The epoch the run directory's checkpoints reach (0: a new run, or --fresh). A run
    directory holding a different config is refused unless --resume or --fresh. Reads only:
    it runs before any Ray process starts. A run on a bucket: its small files are downloaded
    into the mirror first (the bucket is the truth; any machine can resume it)."""
    if storage.is_uri(cfg.run_location) and not fresh:
        try:
            storage.pull(cfg.run_location, cfg.run_dir)
        except OSError as err:
            raise RaytrainError(f"--storage-path {cfg.run.storage_path}: cannot read "
                                f"{cfg.run_location} ({storage.first_line(err)})") from None
    saved_path = os.path.join(cfg.run_dir, "config.yaml")
    if fresh or not os.path.exists(saved_path):
        return 0
    with open(saved_path) as f:
        saved = yaml.safe_load(f) or {}
    changed = sorted(k for k, v in cfg.to_flat().items()  # search settings don't train
                     if k not in NOT_TRAINING and FIELDS[k][0] != "tune"
                     and saved.get(k) != v)
    if changed and not resume:
        diff = ", ".join(f"{k}: {saved.get(k)!r} -> {cfg.to_flat()[k]!r}" for k in changed)
        raise RaytrainError(f"--name {cfg.run.name}: {cfg.run_dir} holds a run with another "
                            f"config ({diff}); pass --resume to continue it with these "
                            "settings, --fresh to delete it and start over, or another --name")
    return latest_checkpoint_epoch(cfg.run_location)


def finished(cfg: TrainConfig, resume: bool = False, fresh: bool = False) -> Summary | None:
    """The run's Summary when it has already trained every epoch (nothing to train), else
    None; refuses another config as ``saved_epochs`` does. Needs no cluster."""
    done = saved_epochs(cfg, resume, fresh)
    model_path = storage.join(cfg.run_location, "model.pt")
    if done < cfg.optim.epochs or not storage.exists(model_path):
        return None
    print(f"run {cfg.run.name} already finished all {done} epochs; nothing to train "
          "(--fresh starts over)", flush=True)
    return Summary(cfg.run_location, report.read_metrics(cfg.run_dir), 0.0, None, model_path)


def prepare_run_dir(cfg: TrainConfig, resume: bool = False, fresh: bool = False) -> int:
    """Create or re-open the run directory; returns the epoch a resumed run restarts after.

    A run directory holding a different config is refused unless --resume or --fresh:
    nothing already saved is touched before that choice is explicit.
    """
    check_storage_writable(cfg.run.storage_path)
    done = saved_epochs(cfg, resume, fresh)
    if fresh and storage.is_uri(cfg.run_location):
        try:
            storage.delete_dir(cfg.run_location)
        except OSError as err:
            raise RaytrainError(f"--fresh: cannot delete {cfg.run_location} "
                                f"({storage.first_line(err)})") from None
    if fresh and os.path.isdir(cfg.run_dir):
        shutil.rmtree(cfg.run_dir)
    os.makedirs(cfg.run_dir, exist_ok=True)
    files.atomic_write(os.path.join(cfg.run_dir, "config.yaml"),
                       yaml.safe_dump(cfg.to_flat(), sort_keys=False))
    try:
        upload_run_files(cfg, ("config.yaml",))
    except storage.UploadError as err:
        raise RaytrainError(f"--storage-path {cfg.run.storage_path}: {err}") from None
    return done


def latest_checkpoint_epoch(run_location: str) -> int:
    """The epoch a re-run resumes after: the newest checkpoint Ray Train registered (the one
    its workers get; rank 0 writes a checkpoint's directory before Ray registers it, and a
    Ctrl-C between the two leaves one Ray never resumes from) that is complete (a copy cut
    short has no state file or a truncated one: torch.save writes a zip, its directory last).
    ``run_location``: a path or a bucket URI."""
    registered = ray_compat.registered_checkpoints(run_location)
    epochs = [int(d.rsplit("_", 1)[1]) for d in storage.listdir(run_location)
              if d.startswith("checkpoint_epoch_") and d.rsplit("_", 1)[1].isdigit()
              and (registered is None or d in registered[0])
              and storage.is_zip(storage.join(run_location, d, files.STATE_FILE))]
    return max(epochs, default=0)


def prune_checkpoints(run_location: str) -> None:
    """Delete the checkpoint directories Ray Train does not reference (one cut off by Ctrl-C
    before it was registered): what is left is what --keep-checkpoints keeps. Storage that
    cannot be read or written now (a failing bucket) is left as it is."""
    try:
        registered = ray_compat.registered_checkpoints(run_location)
        if registered is None:
            return
        for d in storage.listdir(run_location):
            if d.startswith("checkpoint_epoch_") and d not in registered[0]:
                storage.delete_dir(storage.join(run_location, d))
    except OSError:
        pass


def checkpoint_config(keep: int):
    """--keep-checkpoints K for Ray Train: it keeps its num_to_keep best by the score *and* the
    latest, so K-1 best by test_acc plus the newest are K directories at most; K=1: the newest."""
    from ray.train import CheckpointConfig

    if keep == 1:
        return CheckpointConfig(num_to_keep=1)  # no score: ordered by report, the newest kept
    return CheckpointConfig(num_to_keep=keep - 1, checkpoint_score_attribute="test_acc",
                            checkpoint_score_order="max")


# ---------------------------------------------------------------------------- training


def build_trainer(cfg: TrainConfig, shape: Shape, callbacks: list | None = None,
                  driver_outlives_run: bool = False, record: str | None = None,
                  trial: bool = False):
    """Ray Train's TorchTrainer for ``cfg``, less the actors this run has no use for
    (``ray_compat.make_trainer``). ``record``: a file where its controller notes itself
    (``driver.placement``), so that what it leaves can be removed. ``trial``: a Tune trial's
    (CPUs its sibling trials hold are waited for as Ray Train waits: NodeWatch)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.config import LoggingConfig

    from raytrain.worker.ray_entry import train_loop_per_worker

    c = cfg.cluster
    if callbacks is None:
        callbacks = [_run_files_class()(cfg.run_dir, cfg.run_location)]
        if record is not None and ray_compat.has_placement_group_table():
            from raytrain.driver.placement import RecordPlacementGroup

            callbacks.append(RecordPlacementGroup(record))
    need = {"CPU": c.worker_cpus} | ({"GPU": 1} if shape.use_gpu else {})
    # Where the workers fit after a node is lost or joins (a cluster that cannot grow; an
    # autoscaling one gets Ray's own policies, which ask its autoscaler): driver/nodes.py.
    watch = NodeWatch(cfg.run_dir, need, c.min_workers, c.max_workers, c.wait_timeout,
                      cfg.run.checkpoint_every, held_is_waited=not trial)
    return ray_compat.make_trainer(
        train_loop_per_worker,
        fixed_cluster=not shape.can_grow, driver_outlives_run=driver_outlives_run, watch=watch,
        **streaming_inputs(cfg),
        scaling_config=ScalingConfig(num_workers=c.num_workers, use_gpu=shape.use_gpu,
                                     resources_per_worker=need),
        run_config=RunConfig(
            name=cfg.run.name, storage_path=cfg.run.storage_path,
            checkpoint_config=checkpoint_config(cfg.run.keep_checkpoints),
            # A finite controller limit: no failure is retried forever.
            failure_config=FailureConfig(max_failures=c.max_failures,
                                         controller_failure_limit=3),
            callbacks=callbacks,
            worker_runtime_env={"env_vars": worker_env()},
            logging_config=LoggingConfig(log_level="INFO" if cfg.run.verbose else "WARNING")))


def streaming_inputs(cfg: TrainConfig) -> dict[str, Any]:
    """The trainer's data arguments: for streamed images Ray Datasets (listed here, decoded by
    Ray Data tasks on --data-cpus CPUs), the split that keeps every rank's step count equal
    and every val image counted once, and what the workers need to know of the data."""
    flat = cfg.to_flat()
    if not cfg.data.streaming:
        return {"train_loop_config": flat}
    from raytrain.data import pipeline

    d = cfg.data
    # Before the datasets are made: each keeps the DataContext of its making.
    pipeline.reserve_data_cpus(d.data_cpus, cfg.run.verbose)
    datasets, names, counts = pipeline.build_datasets(
        d.dataset, d.data_dir, d.image_size, augment=d.augment is not False, seed=cfg.run.seed,
        decode_on_worker=d.decode == "worker")
    if os.path.isdir(cfg.run_dir):  # class names in label order, beside model.pt
        files.atomic_write(os.path.join(cfg.run_dir, "classes.json"), json.dumps(names))
    flat["stream"] = {"num_classes": len(names), "n_train": counts["train"],
                      "n_val": counts["val"]}
    return {"train_loop_config": flat, "datasets": datasets,
            "dataset_config": pipeline.data_config(
                functools.partial(latest_checkpoint_epoch, cfg.run_location))}


def _storage_failure(*args) -> str:
    from raytrain.checkpoint import storage_failure  # torch: imported when it is needed

    return storage_failure(*args)


def __getattr__(name: str):
    """``RunFiles``, defined on first use: its base class imports ray.train (2 s), which a
    driver imports beside Ray's start (``driver.cluster.connect``), not before it."""
    if name == "RunFiles":
        return _run_files_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _run_files_class() -> type:
    from ray.train.v2.api.callback import UserCallback

    class RunFiles(_RunFiles, UserCallback):
        __doc__ = _RunFiles.__doc__

    RunFiles.__module__, RunFiles.__qualname__ = __name__, "RunFiles"  # pickled by name
    return RunFiles


class _RunFiles:
    """Train-controller callback (runs on the driver's node): writes metrics.jsonl/.csv and
    events.jsonl in the run directory after every report; a run on a bucket: in the driver's
    mirror, then uploads them to ``run_location``."""

    def __init__(self, run_dir: str, run_location: str | None = None):
        self.run_dir = run_dir
        self.run_location = run_location or run_dir
        self._tensorboard = None
        self._saved = 0  # the epoch of the latest checkpoint reported: in storage already

    def after_report(self, run_context, metrics, checkpoint) -> None:
        m = metrics[0]
        if checkpoint is not None:
            self._saved = m["epoch"]
        report.record_epoch(self.run_dir, m)
        if self._tensorboard is None:
            self._tensorboard = _summary_writer(os.path.join(self.run_dir, "tensorboard"))
        for key in report.METRICS[1:]:
            self._tensorboard.add_scalar(key, m[key], m["epoch"])
        self._tensorboard.flush()
        if storage.is_uri(self.run_location):
            try:
                storage.upload(self.run_dir, self.run_location, EPOCH_FILES)
            except storage.UploadError as err:
                if "error" not in m:  # else the run stops on the failure m names already
                    err.kept = self._saved  # the bucket may not answer the driver's question
                    raise

    def after_exception(self, run_context, worker_exceptions) -> None:
        rank, err = sorted(worker_exceptions.items())[0]
        try:
            report.append_event(self.run_dir, {"event": "worker_failure", "rank": rank,
                                               "error": f"rank {rank}: {short(err)}",
                                               "time": time.time()})
        except OSError:  # a full disk: raising here would fail the run on this, not on err
            pass


def _summary_writer(logdir: str):
    """tensorboardX's SummaryWriter, imported without torch in a process that has none (the
    Train controller: ray_compat.TorchBackendConfig): tensorboardX 2.6's writer imports torch
    only to name a type (writer.py ``numpy_compatible``) and takes numpy's where torch cannot
    be imported; with it, 1.3-2 s of the controller's CPU in each run's first epoch."""
    if "torch" not in sys.modules and "tensorboardX" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails here
        try:
            importlib.import_module("tensorboardX")
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    return SummaryWriter(logdir)


def fit(cfg: TrainConfig, started_at: float, resume: bool = False, fresh: bool = False
        ) -> Summary:
    """Run one training job on the connected cluster and write the run files."""
    connected_at = time.time()
    shape = preflight(cfg)
    train_env(shape)
    summary = finished(cfg, resume=resume, fresh=fresh)
    if summary is not None:
        return summary
    done = prepare_run_dir(cfg, resume=resume, fresh=fresh)
    prestart_workers(local_workers(cfg, shape))  # they import while the trainer is made
    if done:
        print(f"resuming run {cfg.run.name} from its epoch {done} checkpoint "
              f"({cfg.optim.epochs - done} epochs to go)", flush=True)
    fd, record = tempfile.mkstemp(prefix="raytrain-controller-", suffix=".jsonl")
    os.close(fd)
    trainer = build_trainer(cfg, shape, record=record)
    driver = [("Ray up", connected_at), ("preflight", time.time())]
    # Both read the run directory's files on the driver while fit() blocks (driver/tracking.py
    # says why MLflow is fed from here, not from the controller's RunFiles callback).
    with tracking.RunTracker(cfg) as tracker:
        with console.EpochPrinter(cfg.run_dir, cfg.optim.epochs):
            try:
                result = trainer.fit()
            except (KeyboardInterrupt, SystemExit):  # Ray's Ctrl-C handler aborted the run
                result = None
            except Exception as err:  # Ray raises TrainingFailedError past the failure budget
                _upload_quietly(cfg)
                raise TrainingError(_failed(cfg, err)) from None
            finally:  # the controller is gone: nothing registers a checkpoint any more
                prune_checkpoints(cfg.run_location)
                remove_left_groups(record)
        if result is not None and result.error is not None:
            _upload_quietly(cfg)
            raise TrainingError(_failed(cfg, result.error))
        rows = report.read_metrics(cfg.run_dir)
        if rows and "error" in rows[-1]:
            _upload_quietly(cfg)
            raise TrainingError(rows[-1]["error"])
        if not rows or rows[-1]["epoch"] < cfg.optim.epochs:  # Ctrl-C: Ray aborted the run
            _upload_quietly(cfg)
            raise Interrupted(f"interrupted after epoch {rows[-1]['epoch'] if rows else 0} "
                              f"of {cfg.optim.epochs}; rerun the same command to resume")
        model_path = export_model(cfg.run_dir, result.checkpoint)
        report.plot_curves(cfg.run_dir, rows)
        tracker.finish("FINISHED")  # model.pt, learning_curves.png, config.yaml
        if storage.is_uri(cfg.run_location):
            try:
                upload_run_files(cfg)
            except storage.UploadError as err:
                raise TrainingError(_storage_failure(
                    "the run trained but its files did not reach the bucket", err,
                    cfg.run.storage_path, f"{_kept(cfg)}; the files are in {cfg.run_dir}")
                ) from None
            model_path = storage.join(cfg.run_location, "model.pt") if model_path else None
    # The first epoch this command trained (a worker group restarted after a failure adds a
    # later first_step_at; a resumed run's earlier rows are older than started_at).
    first = [r for r in rows if r.get("first_step_at", 0) > started_at]
    return Summary(cfg.run_location, rows, time.time() - started_at,
                   first[0]["first_step_at"] - started_at if first else None, model_path,
                   report.startup_phases(started_at, driver, first[0]) if first else None)


def local_workers(cfg: TrainConfig, shape: Shape) -> int:
    """How many of the run's workers start on this node, where all fit on it: their processes
    are prestarted while the controller starts (driver.cluster.prestart_workers). On several
    nodes, or with GPUs (not measured yet), the controller starts them."""
    import ray

    if not shape.one_host or shape.use_gpu:
        return 0
    c = cfg.cluster
    return min(c.max_workers, int(ray.available_resources().get("CPU", 0) // c.worker_cpus))


def remove_left_groups(record: str) -> None:
    """Remove the placement groups the run's controller left, then ``record``. A controller
    that ends abnormally (Ctrl-C, a failure past its budget) may leave its workers' group, or
    make one in its last moments, and Ray keeps it until the driver's job ends: for a driver
    that goes on (a notebook, the test suite's shared cluster) its CPUs stayed held for good
    (the cause of the suite's "session cluster's CPUs are still held"). The run is over here,
    so any group its controller made serves nothing."""
    try:
        from raytrain.driver.placement import controllers_in, remove_groups

        if ray_compat.has_placement_group_table():
            remove_groups(controllers_in([record]), alive_too=True)
    except Exception:  # noqa: BLE001 - Ray already shut down (Ctrl-C): nothing is left
        pass
    finally:
        with contextlib.suppress(OSError):
            os.remove(record)


def export_model(run_dir: str, ckpt) -> str | None:
    """model.pt: a plain state_dict of the unwrapped model, loadable without raytrain. Copied
    from the checkpoint where rank 0 wrote it (a run's last epoch), else written by a process
    of its own: the driver imports no torch (1.3 s of every run's start, issue #27)."""
    if ckpt is None:
        return None
    path = os.path.join(run_dir, files.MODEL_FILE)
    with ckpt.as_directory() as directory:
        ready = os.path.join(directory, files.MODEL_FILE)
        if os.path.isfile(ready):
            with files.replacing(path) as tmp:
                shutil.copyfile(ready, tmp)
            return path
        done = subprocess.run([sys.executable, "-m", "raytrain.checkpoint", directory, path],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise RaytrainError((done.stderr.strip().splitlines() or ["model.pt: export failed"])[-1])
    return path


def _kept(cfg: TrainConfig, saved: int | None = None) -> str:
    """What a storage failure left: the latest checkpoint, as the storage says or, where it
    cannot answer, as ``saved`` (the latest epoch reported with a checkpoint) or the metrics
    say (an epoch is recorded after Ray Train registered its checkpoint)."""
    try:
        done = latest_checkpoint_epoch(cfg.run_location)
    except OSError:
        every = cfg.run.checkpoint_every
        done = saved if saved is not None else max(
            (r["epoch"] for r in report.read_metrics(cfg.run_dir)
             if "error" not in r and r["epoch"] % every == 0), default=0)
    return f"the epoch {done} checkpoint is intact" if done else "no checkpoint was saved"


def _failed(cfg: TrainConfig, err: BaseException) -> str:
    cause = getattr(err, "controller_failure", None)  # Ray's ControllerError
    # metrics.jsonl etc. on a full disk or not uploaded to the bucket; or a write of Ray's
    # own to a failing bucket (its checkpoint record, between rank 0's save and our upload)
    if isinstance(cause, OSError):
        what = ("writing the run files failed" if cause.errno or isinstance(
            cause, storage.UploadError) else "writing to the run's storage failed")
        return _storage_failure(what, cause, cfg.run.storage_path,
                                          _kept(cfg, getattr(cause, "kept", None)))
    if isinstance(cause, NoRoom):  # a node was lost and none came back in time
        return (f"{cause}; {_kept(cfg)}: rerun the same command once the cluster has room "
                "(or pass --num-workers MIN:MAX to go on with fewer workers)")
    restarts = sum(1 for e in files.read_jsonl(os.path.join(cfg.run_dir, "events.jsonl"))
                   if e["event"] == "worker_failure")
    return (f"training failed ({short(err)}; {restarts} worker failure(s), --max-failures "
            f"{cfg.cluster.max_failures}); rerun the same command to resume from the latest "
            "checkpoint")


