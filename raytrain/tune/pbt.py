"""PBT plumbing: a trial that starts from another trial's training state, and the reports
(with checkpoints) a PBT trial hands Tune itself.

PBT needs a Tune checkpoint to exploit, and ``TuneReportCallback`` only forwards the path of the
Train checkpoint as a metric. With ``--scheduler pbt`` the trial reports to Tune itself:
``ForwardReports`` (a Train callback) hands each report and its checkpoint to the trial process,
which reports it to Tune with a copy of the training state (``source.json`` says whose it is).
A trial given such a checkpoint starts a new Train run from it (``StartFrom``), its optimizer
and lr schedule re-made for the trial's new lr and batch size (``retarget``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import warnings
from typing import Any

from raytrain import files
from raytrain.config import NUM_CLASSES, TrainConfig

SOURCE_FILE = "source.json"


def starting_point(tune_ckpt, trial_id: str) -> dict[str, Any] | None:
    """Where a (re)started trial begins: None (epoch 0), or the source of its Tune checkpoint.

    Each source gets its own Train run (``segment``): starting again from the same source (the
    search was interrupted) resumes that run from its own latest checkpoint.
    """
    if tune_ckpt is None:
        return None
    with tune_ckpt.as_directory() as directory:
        with open(os.path.join(directory, SOURCE_FILE)) as f:
            source = json.load(f)
        source["tune_checkpoint"] = tune_ckpt
    source["segment"] = f"from-{source['trial_id']}-e{source['epoch']:04d}"
    return source


def prepare_start(start: dict[str, Any], cfg: TrainConfig, trial_dir: str) -> str:
    """The training state this trial's new Train run starts from, fitted to its config."""
    from raytrain import checkpoint  # torch: a trial that never exploits has no need of it

    state_dir = os.path.join(trial_dir, "starts", start["segment"])
    if os.path.exists(os.path.join(state_dir, files.STATE_FILE)):
        return state_dir
    os.makedirs(state_dir, exist_ok=True)
    with start["tune_checkpoint"].as_directory() as directory:
        state = checkpoint.load_state(directory)
    state = retarget(state, cfg)
    checkpoint.save(state, state_dir)
    return state_dir


def retarget(state: dict[str, Any], cfg: TrainConfig) -> dict[str, Any]:
    """``state`` with its optimizer and lr schedule re-made for ``cfg`` at the same epoch.

    PBT's explore changes lr and batch size; a restored optimizer would keep the old lr, and a
    restored schedule the old length. Weights, momentum buffers and RNG state carry over; the
    schedule is the one ``cfg`` would have had, stepped to the epoch the state is at.
    """
    old = state.get("config", {})
    keys = ("lr", "batch_size", "num_workers")
    if all(old.get(k) == v for k, v in cfg.to_flat().items() if k in keys):
        return state
    from raytrain.data import load_dataset, steps_per_epoch
    from raytrain.worker.loop import make_optimizer, make_scheduler
    from raytrain.models import build_model

    data = load_dataset(cfg.data.dataset, cfg.data.data_dir, cfg.data.synthetic_size)
    steps = steps_per_epoch(len(data.train_y), cfg.cluster.max_workers, cfg.per_worker_batch)
    model = build_model(cfg.model.model, NUM_CLASSES[cfg.data.dataset], stem=cfg.model.stem)
    optimizer = make_optimizer(model, cfg)
    schedule = make_scheduler(optimizer, cfg, steps * cfg.optim.epochs)
    done = state["epoch"]
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
        warnings.simplefilter("ignore")
        for _ in range(done * steps):
            schedule.step()
    groups = [{**g_old, **{k: v for k, v in g_new.items() if k != "params"}}
              for g_old, g_new in zip(state["optimizer"]["param_groups"],
                                      optimizer.state_dict()["param_groups"])]
    return {**state, "optimizer": {**state["optimizer"], "param_groups": groups},
            "scheduler": schedule.state_dict(), "step": done * steps, "config": cfg.to_flat()}


class StartFrom:
    """Train worker function of a run that starts from a given training state (PBT).

    Train V2 has no ``resume_from_checkpoint``. This runs the one worker entry point,
    ``train_loop_per_worker``, given the state to start from: it resumes from the run's own
    checkpoint when there is one (after a worker-group restart, or when the search resumes),
    which is newer, and from this state otherwise.
    """

    def __init__(self, state_dir: str):
        self.state_dir = state_dir

    def __call__(self, config: dict[str, Any]) -> None:
        from raytrain.worker.ray_entry import train_loop_per_worker

        train_loop_per_worker(config, start_dir=self.state_dir)


def _user_callback_base():
    from ray.train.v2.api.callback import UserCallback

    return UserCallback


class ForwardReports(_user_callback_base()):
    """Train-controller callback: hands each report and its checkpoint to the trial process.

    ``TuneReportCallback`` forwards only the checkpoint's path (as a metric); PBT needs a Tune
    checkpoint to exploit, and only the trial process can report one (``fit_forwarding``).
    """

    def __init__(self):
        from ray.util.queue import Queue

        self.queue = Queue(maxsize=1, actor_options={"num_cpus": 0})

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self.queue.put((dict(metrics[0]), checkpoint))  # waits until the trial took the last


def fit_forwarding(trainer, forward: ForwardReports, trial_id: str, segment: str,
                   every: int, epochs: int) -> None:
    """``trainer.fit()`` in a thread; this one reports to Tune, with checkpoints."""
    from ray.util.queue import Empty

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the trial thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name="raytrain-trial-fit", daemon=True)
    thread.start()
    while True:
        alive = thread.is_alive()
        try:
            metrics, ckpt = forward.queue.get(block=alive, timeout=0.5 if alive else None)
        except Empty:
            if alive:
                continue
            break
        if ckpt is not None:
            metrics = {**metrics, "checkpoint_path": ckpt.path}  # as TuneReportCallback does
        # A Tune copy per perturbation interval: PBT saves and exploits at those epochs.
        keep = ckpt is not None and "error" not in metrics and (
            metrics["epoch"] % every == 0 or metrics["epoch"] == epochs)
        report_to_tune(metrics, ckpt if keep else None, trial_id, segment)
    if "error" in outcome:
        raise outcome["error"]


def report_to_tune(metrics: dict[str, Any], ckpt, trial_id: str, segment: str) -> None:
    import ray.tune

    if ckpt is None:
        ray.tune.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="raytrain-tune-ckpt-") as directory:
        with ckpt.as_directory() as train_dir:
            shutil.copy2(os.path.join(train_dir, files.STATE_FILE), directory)
        with open(os.path.join(directory, SOURCE_FILE), "w") as f:
            json.dump({"trial_id": trial_id, "epoch": metrics["epoch"], "segment": segment,
                       "train_checkpoint": ckpt.path, "metrics": metrics}, f)
        ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(directory))

