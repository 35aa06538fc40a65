"""One Tune trial: the same TorchTrainer as a plain run, with the trial's lr and batch size.

Trials run in Tune's trial processes; each writes its own run directory,
``STORAGE_PATH/NAME/trials/TRIAL_ID/`` (config.yaml, metrics, events.jsonl, starts.jsonl).
"""

from __future__ import annotations

import os
import time
from typing import Any

import yaml

from raytrain import files, report
from raytrain.config import TrainConfig
from raytrain.driver import run as driver_run
from raytrain.driver.cluster import train_env
from raytrain.driver.preflight import Shape
from raytrain.errors import short
from raytrain.tune.pbt import ForwardReports, StartFrom, fit_forwarding, prepare_start, \
    starting_point
from raytrain.tune.placement import PG_FILE, RecordPlacementGroup

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
    trial_dir = os.path.join(base["storage_path"], base["name"], "trials", trial_id)
    os.makedirs(trial_dir, exist_ok=True)
    start = starting_point(ray.tune.get_checkpoint(), trial_id)
    segment = start["segment"] if start else "train"
    cfg = TrainConfig.from_flat({**base, "lr": float(config["lr"]),
                                 "batch_size": int(config["batch_size"]), "tune": False,
                                 "storage_path": trial_dir, "name": segment})
    files.atomic_write(os.path.join(trial_dir, "config.yaml"),
                         yaml.safe_dump(cfg.to_flat(), sort_keys=False))
    files.append_jsonl(os.path.join(trial_dir, "starts.jsonl"), {
        "segment": segment, "from_trial": start and start["trial_id"],
        "from_epoch": start and start["epoch"], "lr": cfg.optim.lr,
        "batch_size": cfg.optim.batch_size, "time": time.time()})
    if start and start["epoch"] >= cfg.optim.epochs:  # PBT cloned a trial that had finished
        metrics = {**start["metrics"], "cloned_from": start["trial_id"]}
        report.record_epoch(trial_dir, metrics)
        ray.tune.report(metrics)
        return
    forward = ForwardReports() if base["scheduler"] == "pbt" else None
    callbacks = [driver_run.RunFiles(trial_dir), forward or TuneReportCallback()]
    if reap:  # the driver's PlacementGroupReaper reads what this records
        callbacks.append(RecordPlacementGroup(os.path.join(trial_dir, PG_FILE)))
    trainer = driver_run.build_trainer(cfg, shape, driver_outlives_run=True,
                                       callbacks=callbacks)
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
    rows = report.read_metrics(trial_dir)
    if rows and "error" in rows[-1]:
        raise TrialFailed(rows[-1]["error"])

