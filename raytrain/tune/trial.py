"""One Tune trial: the same TorchTrainer as a plain run, with the trial's lr and batch size.

Trials run in Tune's trial processes; each writes its own run directory,
``STORAGE_PATH/NAME/trials/TRIAL_ID/`` (config.yaml, metrics, events.jsonl, starts.jsonl).
On a bucket that location is a URI: the trial writes its files in its node's mirror of it
(``storage.mirror_of``: on the driver's node, the search mirror's ``trials/TRIAL_ID/``) and
uploads them after every epoch (``RunFiles``); its checkpoints go to the bucket through Ray
Train's storage. The driver downloads every trial's files (``pull_trials``) before it sums up.
"""

from __future__ import annotations

import os
import time
from typing import Any

import yaml

from raytrain import files, report, storage
from raytrain.config import TrainConfig
from raytrain.driver import run as driver_run
from raytrain.driver.cluster import train_env
from raytrain.driver.preflight import Shape
from raytrain.errors import short
from raytrain.tune.pbt import ForwardReports, StartFrom, fit_forwarding, prepare_start, \
    starting_point
from raytrain.tune.placement import PG_FILE, RecordPlacementGroup

STARTS_FILE = "starts.jsonl"
# A trial's files on a bucket: what a restart on any node continues and the driver sums up.
TRIAL_FILES = (*storage.SMALL_FILES, STARTS_FILE)


class TrialFailed(RuntimeError):
    """Raised in a trial so that Tune marks it ERROR (the search goes on); the driver records
    it in the trial's events.jsonl (``search.Progress``): only a trial Tune marks ERROR has
    failed, not one Tune stopped or that finished while Tune was ending it."""


def run_trial(config: dict[str, Any], base: dict[str, Any], shape: Shape, reap: bool = True
              ) -> None:
    """One Tune trial: a TorchTrainer for this trial's lr and batch size, run to the end."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    train_env(shape)  # the trial's process runs the trainer: the driver's settings
    trial_id = ray.tune.get_context().get_trial_id()
    location = trial_location(base["storage_path"], base["name"], trial_id)
    trial_dir = storage.local_dir(location)
    if storage.is_uri(location):  # a restart, maybe on another node: continue its files
        try:
            sync(location, trial_dir)
        except OSError as err:
            raise TrialFailed(f"--storage-path: cannot sync {location} "
                              f"({storage.first_line(err)})") from None
    os.makedirs(trial_dir, exist_ok=True)
    start = starting_point(ray.tune.get_checkpoint(), trial_id)
    segment = start["segment"] if start else "train"
    cfg = TrainConfig.from_flat({**base, "lr": float(config["lr"]),
                                 "batch_size": int(config["batch_size"]), "tune": False,
                                 "storage_path": location, "name": segment})
    files.atomic_write(os.path.join(trial_dir, "config.yaml"),
                         yaml.safe_dump(cfg.to_flat(), sort_keys=False))
    files.append_jsonl(os.path.join(trial_dir, STARTS_FILE), {
        "segment": segment, "from_trial": start and start["trial_id"],
        "from_epoch": start and start["epoch"], "lr": cfg.optim.lr,
        "batch_size": cfg.optim.batch_size, "time": time.time()})
    upload(trial_dir, location, ("config.yaml", STARTS_FILE))
    if start and start["epoch"] >= cfg.optim.epochs:  # PBT cloned a trial that had finished
        metrics = {**start["metrics"], "cloned_from": start["trial_id"]}
        report.record_epoch(trial_dir, metrics)
        ray.tune.report(metrics)
        return
    forward = ForwardReports() if base["scheduler"] == "pbt" else None
    callbacks = [driver_run.RunFiles(trial_dir, location), forward or TuneReportCallback()]
    if reap:  # the driver's PlacementGroupReaper reads what this records
        callbacks.append(RecordPlacementGroup(os.path.join(trial_dir, PG_FILE)))
    # Ray's placement-group cleaner (a detached actor: one more process per trial) only where
    # the driver's reaper cannot see this trial's record: a search on a bucket, on many nodes.
    trainer = driver_run.build_trainer(cfg, shape, callbacks=callbacks, trial=True,
                                       driver_outlives_run=not reap or storage.is_uri(location))
    if start:
        trainer.train_loop_per_worker = StartFrom(prepare_start(start, cfg, trial_dir))
    try:
        if forward:
            fit_forwarding(trainer, forward, trial_id, segment, base["perturbation_interval"],
                           cfg.optim.epochs)
        else:
            trainer.fit()
    except Exception as err:  # past the worker failure budget, or the controller's
        rows = report.read_metrics(trial_dir)
        if not (rows and rows[-1]["epoch"] >= cfg.optim.epochs and "error" not in rows[-1]):
            raise TrialFailed(f"training failed: {short(err)}") from None
        # else every epoch was recorded: what failed came after (Tune ending the trial)
    finally:  # what the controller wrote after its last upload (a worker failure's event)
        upload(trial_dir, location, TRIAL_FILES, quietly=True)
    rows = report.read_metrics(trial_dir)
    if rows and "error" in rows[-1]:
        raise TrialFailed(rows[-1]["error"])


def trial_location(storage_path: str, name: str, trial_id: str) -> str:
    """Where a trial's run lives: STORAGE_PATH/NAME/trials/TRIAL_ID, a path or a bucket URI."""
    return storage.join(storage_path, name, "trials", trial_id)


def upload(trial_dir: str, location: str, names: tuple[str, ...], quietly: bool = False
           ) -> None:
    """Copy ``names`` from the trial's mirror to its location on the bucket (nothing for a
    path). A failure fails the trial, naming the file, unless ``quietly``."""
    if not storage.is_uri(location):
        return
    try:
        storage.upload(trial_dir, location, names)
    except storage.UploadError as err:
        if not quietly:
            raise TrialFailed(f"--storage-path: {err}") from None


def sync(location: str, trial_dir: str) -> None:
    """Make the trial's mirror and its files on the bucket agree: the bucket's copy, unless
    the mirror's extends it (written after the last upload: a trial ended by Ctrl-C between
    recording an epoch and uploading it) or the bucket has none (the MLflow run id the
    driver's tracker wrote); those are uploaded."""
    storage.upload(trial_dir, location, storage.pull_newer(location, trial_dir, TRIAL_FILES))


def pull_trials(location: str, exp_dir: str) -> None:
    """Sync every trial of the search at ``location`` (a bucket URI) with the driver's mirror
    ``exp_dir`` (``sync``): trials on other nodes wrote their files in their own node's
    mirror and uploaded them."""
    trials = storage.join(location, "trials")
    for trial_id in storage.listdir(trials):
        sync(storage.join(trials, trial_id), os.path.join(exp_dir, "trials", trial_id))
