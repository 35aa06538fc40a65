"""The Tune layer: many trainings searching lr and batch size, weak ones stopped early.

    python -m raytrain.fit --tune --num-samples 8 --num-workers 1 --dataset digits --epochs 10

Train V2 has no ``Tuner(trainer)``: a Tune trial is ``run_trial``, a function that builds the
same TorchTrainer as a plain run (``launch.build_trainer``) with the trial's lr and batch size
and calls ``fit()``. The trial itself holds no CPU (``TRIAL_RESOURCES``); its Train workers
hold ``--num-workers x --cpus-per-worker``, so at most ``max_concurrent`` trials run at once:
a trial that held CPUs of its own would leave its own workers unplaceable (Ray issue #54305).

Files, under ``STORAGE_PATH/NAME/`` (Tune's experiment directory; Tune keeps its own state and
``tune-TRIAL_ID/`` folders there):

    config.yaml            the resolved settings: search space and the flags all trials share
    results.csv, tune.png  one row per trial; accuracy vs epoch per trial, lr vs best accuracy
    model.pt               the best trial's best weights (a plain state_dict)
    trials/TRIAL_ID/       the trial's run directory: config.yaml, metrics.jsonl/.csv,
                           events.jsonl, starts.jsonl (where each start came from) and one Train
                           run per start: train/ first, from-TRIAL-eEPOCH/ after a PBT exploit
                           or pause, each holding checkpoint_epoch_NNNN/

PBT needs a Tune checkpoint to exploit, and ``TuneReportCallback`` only forwards the path of the
Train checkpoint as a metric. With ``--scheduler pbt`` the trial reports to Tune itself:
``ForwardReports`` (a Train callback) hands each report and its checkpoint to the trial process,
which reports it to Tune with a copy of the training state (``source.json`` says whose it is).
A trial given such a checkpoint starts a new Train run from it (``StartFrom``), its optimizer
and lr schedule re-made for the trial's new lr and batch size (``retarget``).
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import yaml

from raytrain import checkpoint, launch, report
from raytrain.config import NUM_CLASSES, ConfigError, RaytrainError, TrainConfig

METRIC, MODE = "test_acc", "max"
# ASHA ranks trials at its rungs by test loss, not accuracy: early in training (a onecycle
# warm-up, a tiny dataset) many trials sit at exactly chance accuracy, and Ray's ASHA lets a
# trial that ties the cutoff go on, so nothing was stopped (digits seed 2: every trial at 0.10
# for 4 epochs: 48% of the worker-epochs of --scheduler none; by loss: 20%, same best trial;
# benchmarks/asha_replay.py replays the measured curves).
RUNG_METRIC, RUNG_MODE = "test_loss", "min"
# Tune refuses an all-zero request; a trial only waits on its TorchTrainer, whose controller is
# a num_cpus=0 actor too. A byte of memory instead of a "sliver of CPU" keeps CPU accounting
# whole: with {"CPU": 0.01}, two 1-CPU trials on 2 CPUs would need 2.02 and one would stall.
TRIAL_RESOURCES = {"CPU": 0, "memory": 1}
SOURCE_FILE = "source.json"
PG_FILE = "placement_groups.jsonl"
# Settings a resumed search may change (they do not change what the trials train).
NOT_SEARCH = launch.NOT_TRAINING - {"num_workers", "cpus_per_worker"} | {
    "max_concurrent_trials"}
RESULT_COLUMNS = ("trial_id", "lr", "batch_size", "status", "epochs_run", "last_epoch",
                  "final_test_acc", "best_test_acc", "best_epoch", "checkpoint",
                  "started_from", "error")


class TrialFailed(RuntimeError):
    """Raised in a trial so that Tune marks it ERROR (the search goes on)."""


@dataclass
class TuneSummary:
    exp_dir: str
    rows: list[dict[str, Any]]
    epochs: int
    num_workers: int
    wall_s: float
    plot: str | None
    model_path: str | None

    @property
    def best(self) -> dict[str, Any] | None:
        ok = [r for r in self.rows if r["status"] != "failed" and r["best_test_acc"] != ""]
        return max(ok, key=lambda r: r["best_test_acc"], default=None)

    @property
    def worker_epochs(self) -> int:
        """Compute spent: epochs trained over all trials x workers per trial."""
        return sum(r["epochs_run"] for r in self.rows) * self.num_workers


# ---------------------------------------------------------------------------- driver


def run(cfg: TrainConfig, started_at: float, resume: bool = False, fresh: bool = False
        ) -> TuneSummary:
    """Run (or resume) the search on the connected cluster and write its result files."""
    from ray import tune

    check(cfg)
    shape = launch.preflight(cfg)
    exp_dir = cfg.run_dir
    base = prepare_exp_dir(cfg, resume, fresh)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=base, shape=shape), TRIAL_RESOURCES)
    concurrent = cfg.tune.max_concurrent_trials or placeable_trials(cfg, shape.use_gpu)
    if tune.Tuner.can_restore(exp_dir):
        print(f"resuming the search in {exp_dir} (finished trials are kept)", flush=True)
        tuner = tune.Tuner.restore(exp_dir, trainable=trainable)
    else:
        print(f"tuning: {describe(cfg, concurrent)}", flush=True)
        tuner = tune.Tuner(trainable, param_space=search_space(cfg),
                           tune_config=tune_config(cfg, concurrent),
                           run_config=run_config(cfg))
    with PlacementGroupReaper(os.path.join(exp_dir, "trials")), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reuse_actors")  # PBT: we restart trials
        grid = tuner.fit()
    summary = summarize(cfg, grid, time.time() - started_at)
    unfinished = [r for r in summary.rows if r["status"] in ("pending", "running", "paused")]
    if unfinished:
        raise launch.Interrupted(f"search interrupted with {len(unfinished)} trial(s) "
                                 "unfinished; rerun the same command to resume it")
    if summary.best is None:
        reasons = "; ".join(f"{r['trial_id']}: {r['error']}" for r in summary.rows)
        raise launch.TrainingError(f"all {len(summary.rows)} trials failed ({reasons[:400]})")
    return summary


def check(cfg: TrainConfig) -> None:
    """Checks that span sections (each section checked its own fields)."""
    t, epochs = cfg.tune, cfg.optim.epochs
    for size in t.batch_size_choices():
        if size < cfg.cluster.max_workers:
            raise ConfigError("batch_sizes", t.batch_sizes, f"sizes of at least --num-workers "
                              f"({cfg.cluster.max_workers}): the batch is global")
    if t.scheduler == "asha" and t.grace_period > epochs:
        raise ConfigError("grace_period", t.grace_period, f"at most --epochs ({epochs})")
    if t.scheduler == "pbt" and t.perturbation_interval >= epochs:
        raise ConfigError("perturbation_interval", t.perturbation_interval,
                          f"less than --epochs ({epochs}) or PBT never perturbs")


def prepare_exp_dir(cfg: TrainConfig, resume: bool, fresh: bool) -> dict[str, Any]:
    """Create or re-open STORAGE/NAME; returns the flat config every trial starts from."""
    exp_dir = cfg.run_dir
    if fresh and os.path.isdir(exp_dir):
        shutil.rmtree(exp_dir)
    flat = cfg.to_flat()
    saved_path = os.path.join(exp_dir, "config.yaml")
    if os.path.exists(saved_path):
        with open(saved_path) as f:
            saved = yaml.safe_load(f) or {}
        if not saved.get("tune"):
            raise RaytrainError(f"--name {cfg.run.name}: {exp_dir} holds a training run, not a "
                                "search; use another --name (or --fresh to delete it)")
        changed = sorted(k for k, v in flat.items() if k not in NOT_SEARCH and saved.get(k) != v)
        if changed and not resume:
            diff = ", ".join(f"{k}: {saved.get(k)!r} -> {flat[k]!r}" for k in changed)
            raise RaytrainError(f"--name {cfg.run.name}: {exp_dir} holds a search with other "
                                f"settings ({diff}); pass --resume to continue it (its search "
                                "space stays), --fresh to start over, or another --name")
    try:
        os.makedirs(exp_dir, exist_ok=True)
    except OSError as err:
        raise RaytrainError(f"--storage-path {cfg.run.storage_path}: cannot create {exp_dir} "
                            f"({err.strerror})") from None
    report._atomic_write(saved_path, yaml.safe_dump(flat, sort_keys=False))
    # Trials run in their own working directory: hand them absolute paths.
    for key in ("data_dir", "pretrained"):
        if flat.get(key):
            flat[key] = os.path.abspath(flat[key])
    return flat


def placeable_trials(cfg: TrainConfig, use_gpu: bool) -> int:
    """How many trials' worker groups the cluster can hold at once (at least 1)."""
    import ray

    c = cfg.cluster
    need = {"CPU": c.cpus_per_worker} | ({"GPU": 1.0} if use_gpu else {})
    workers = sum(int(min(n["Resources"].get(k, 0.0) // v for k, v in need.items()))
                  for n in ray.nodes() if n.get("Alive"))
    return max(1, workers // c.max_workers)


def search_space(cfg: TrainConfig) -> dict[str, Any]:
    from ray import tune

    kind, values = cfg.tune.lr_space()
    if kind == "range":
        lr = tune.loguniform(*values)
    elif cfg.tune.search == "optuna":  # searchers take no grid: a categorical choice
        lr = tune.choice(values)
    else:
        lr = tune.grid_search(values)
    return {"lr": lr, "batch_size": tune.choice(cfg.tune.batch_size_choices())}


def tune_config(cfg: TrainConfig, concurrent: int):
    from ray import tune

    t = cfg.tune
    if t.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(metric=METRIC, mode=MODE, seed=cfg.run.seed)
    else:
        from ray.tune.search.basic_variant import BasicVariantGenerator

        # A searcher passed in ignores TuneConfig's limit; this one takes its own.
        search = BasicVariantGenerator(random_state=cfg.run.seed, max_concurrent=concurrent)
    # Metric and mode are set on the scheduler and searcher (ASHA ranks by RUNG_METRIC);
    # Tune refuses them here as well.
    return tune.TuneConfig(scheduler=scheduler(cfg),
                           search_alg=search, num_samples=t.num_samples,
                           max_concurrent_trials=concurrent if t.search == "optuna" else None,
                           reuse_actors=False,
                           trial_dirname_creator=_tune_dirname)


def scheduler(cfg: TrainConfig):
    """ASHA / PBT / FIFO; time is the reported ``epoch`` (a restarted trial keeps counting)."""
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler, PopulationBasedTraining

    t = cfg.tune
    if t.scheduler == "asha":
        return LateCheckASHA(time_attr="epoch", metric=RUNG_METRIC, mode=RUNG_MODE,
                             max_t=cfg.optim.epochs, grace_period=t.grace_period,
                             reduction_factor=t.reduction_factor)
    if t.scheduler == "pbt":
        kind, values = t.lr_space()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return PopulationBasedTraining(
                time_attr="epoch", metric=METRIC, mode=MODE,
                perturbation_interval=t.perturbation_interval,
                hyperparam_mutations={
                    "lr": tune.loguniform(*values) if kind == "range" else values,
                    "batch_size": t.batch_size_choices()})
    return FIFOScheduler()  # no metric: runs every trial to the end


def _asha_base():
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler


class LateCheckASHA(_asha_base()):
    """Ray's ASHAScheduler, plus a late check of the rungs a trial has passed.

    Ray's ASHA decides once, when a trial reaches a rung, against the trials recorded there so
    far: the first to arrive always goes on. Trials that start together (the first
    ``max_concurrent`` of every search) race through the rungs side by side, so a bad one that
    kept arriving first ran all its epochs (digits seed 0: a lr 1.3e-4 trial at chance
    accuracy ran 20 of 20). At each later report the late check asks again whether the trial is
    in the top 1/reduction_factor of every rung it passed, now that others are recorded there,
    and stops it if not: the promotion rule of ASHA's paper, applied after the fact.
    """

    def on_trial_result(self, tune_controller, trial, result):
        from ray.tune.schedulers import TrialScheduler

        action = super().on_trial_result(tune_controller, trial, result)
        if action == TrialScheduler.CONTINUE and self._metric in result and fell_behind(
                self._trial_info[trial.trial_id], trial.trial_id, result[self._time_attr]):
            self._num_stopped += 1
            return TrialScheduler.STOP
        return action


def fell_behind(bracket, trial_id: str, now: float) -> bool:
    """Whether ``trial_id`` is below the cutoff of a rung it passed before ``now`` (the cutoff
    of everything recorded at that rung, the trial included: with it alone there, never)."""
    for milestone, recorded in bracket._rungs:
        if milestone < now and trial_id in recorded:
            mine = recorded[trial_id]
            if mine < bracket.cutoff(recorded):  # NaN compares False: never stopped for it
                return True
    return False


def run_config(cfg: TrainConfig):
    from ray import tune

    return tune.RunConfig(
        name=cfg.run.name, storage_path=cfg.run.storage_path,
        # A failed trial is recorded and the search goes on; it is not retried.
        failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
        # Tune checkpoints (PBT only: one per perturbation interval) are all kept: with a
        # num_to_keep, Tune 2.60 logged errors deleting checkpoints of exploited trials.
        checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
        callbacks=[Progress(cfg.run_dir, cfg.optim.epochs)], verbose=1 if cfg.run.verbose else 0)


def describe(cfg: TrainConfig, concurrent: int) -> str:
    t = cfg.tune
    kind, values = t.lr_space()
    lr = (f"lr log-uniform in [{values[0]:g}, {values[1]:g}]" if kind == "range"
          else "lr in {" + ", ".join(f"{v:g}" for v in values) + "}")
    trials = t.num_samples * (len(values) if kind == "values" and t.search == "random" else 1)
    sched = {"asha": f"ASHA (grace {t.grace_period}, reduction {t.reduction_factor})",
             "pbt": f"PBT (perturbation every {t.perturbation_interval} epochs)",
             "none": "no early stopping"}[t.scheduler]
    return (f"{trials} trials, {lr}, batch size in {{{t.batch_sizes}}}, {t.search} search, "
            f"{sched}, {concurrent} at once x {cfg.cluster.max_workers} worker(s), "
            f"{cfg.optim.epochs} epochs max")


def _tune_dirname(trial) -> str:
    return f"tune-{trial.trial_id}"


def _trials(grid) -> list:
    # ResultGrid has no public per-trial status; its ExperimentAnalysis has the Trials.
    return list(grid._experiment_analysis.trials)


def saved_statuses(exp_dir: str) -> dict[str, str]:
    """Trial statuses as Tune saved them. After Ctrl-C, Tune saves the experiment and then
    marks every trial in memory TERMINATED; the saved state still says which were unfinished
    (and a re-run resumes those)."""
    from ray.tune import ExperimentAnalysis

    try:
        return {t.trial_id: t.status for t in ExperimentAnalysis(exp_dir).trials}
    except Exception:  # noqa: BLE001 - no saved state: the in-memory statuses stand
        return {}


def _progress_base():
    from ray.tune import Callback

    return Callback


class Progress(_progress_base()):
    """Tune callback on the driver: one line when a trial starts, ends or fails."""

    def __init__(self, exp_dir: str, epochs: int):
        self.exp_dir, self.epochs = exp_dir, epochs

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        c = trial.config
        print(f"trial {trial.trial_id} started: lr {c['lr']:.3g}, batch {c['batch_size']}",
              flush=True)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        r = trial.last_result or {}
        if "error" in r:  # the scheduler stopped it on its NaN epoch, before it could raise
            print(f"trial {trial.trial_id} failed: {r['error']}", flush=True)
            return
        epoch = r.get("epoch", 0)
        how = "finished" if epoch >= self.epochs else "stopped early"
        acc = f", test_acc {r[METRIC]:.4f}" if METRIC in r else ""
        print(f"trial {trial.trial_id} {how} at epoch {epoch}/{self.epochs}{acc}", flush=True)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        print(f"trial {trial.trial_id} failed: {trial_error(trial.trial_id, self.exp_dir)}",
              flush=True)


# ---------------------------------------------------------------------------- trial


def run_trial(config: dict[str, Any], base: dict[str, Any], shape: launch.Shape) -> None:
    """One Tune trial: a TorchTrainer for this trial's lr and batch size, run to the end."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    launch.train_env(shape)  # the trial's process runs the trainer: the driver's settings
    trial_id = ray.tune.get_context().get_trial_id()
    trial_dir = os.path.join(base["storage_path"], base["name"], "trials", trial_id)
    os.makedirs(trial_dir, exist_ok=True)
    start = starting_point(ray.tune.get_checkpoint(), trial_id)
    segment = start["segment"] if start else "train"
    cfg = TrainConfig.from_flat({**base, "lr": float(config["lr"]),
                                 "batch_size": int(config["batch_size"]), "tune": False,
                                 "storage_path": trial_dir, "name": segment})
    report._atomic_write(os.path.join(trial_dir, "config.yaml"),
                         yaml.safe_dump(cfg.to_flat(), sort_keys=False))
    _append_jsonl(os.path.join(trial_dir, "starts.jsonl"), {
        "segment": segment, "from_trial": start and start["trial_id"],
        "from_epoch": start and start["epoch"], "lr": cfg.optim.lr,
        "batch_size": cfg.optim.batch_size, "time": time.time()})
    if start and start["epoch"] >= cfg.optim.epochs:  # PBT cloned a trial that had finished
        metrics = {**start["metrics"], "cloned_from": start["trial_id"]}
        report.record_epoch(trial_dir, metrics)
        ray.tune.report(metrics)
        return
    forward = ForwardReports() if base["scheduler"] == "pbt" else None
    trainer = launch.build_trainer(cfg, shape, driver_outlives_run=True, callbacks=[
        launch.RunFiles(trial_dir), forward or TuneReportCallback(),
        RecordPlacementGroup(os.path.join(trial_dir, PG_FILE))])
    if start:
        trainer.train_loop_per_worker = StartFrom(prepare_start(start, cfg, trial_dir))
    try:
        if forward:
            fit_forwarding(trainer, forward, trial_id, segment, base["perturbation_interval"],
                           cfg.optim.epochs)
        else:
            trainer.fit()
    except Exception as err:  # past the worker failure budget, or the controller's
        fail(trial_dir, f"training failed: {launch._short(err)}")
    rows = report.read_metrics(trial_dir)
    if rows and "error" in rows[-1]:
        fail(trial_dir, rows[-1]["error"])


def fail(trial_dir: str, reason: str) -> None:
    report.append_event(trial_dir, {"event": "trial_failed", "error": reason,
                                    "time": time.time()})
    raise TrialFailed(reason)


def _append_jsonl(path: str, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


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
    state_dir = os.path.join(trial_dir, "starts", start["segment"])
    if os.path.exists(os.path.join(state_dir, checkpoint.STATE_FILE)):
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
    from raytrain.loop import make_optimizer, make_scheduler
    from raytrain.models import build_model

    data = load_dataset(cfg.data.dataset, cfg.data.data_dir, cfg.data.synthetic_size)
    steps = steps_per_epoch(len(data.train_y), cfg.cluster.max_workers, cfg.per_worker_batch)
    model = build_model(cfg.model.model, NUM_CLASSES[cfg.data.dataset])
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

    Train V2 has no ``resume_from_checkpoint``. This runs ``loop.train_loop_per_worker``, which
    resumes from ``ray.train.get_checkpoint()``, with that call answering the given state until
    the run has a checkpoint of its own (after a worker-group restart, or when the search
    resumes), which is newer. Patching the call, in this worker process only, keeps one worker
    entry point instead of a copy of it.
    """

    def __init__(self, state_dir: str):
        self.state_dir = state_dir

    def __call__(self, config: dict[str, Any]) -> None:
        import ray.train

        from raytrain import loop

        if ray.train.get_checkpoint() is not None:
            return loop.train_loop_per_worker(config)
        own, start = ray.train.get_checkpoint, ray.train.Checkpoint(self.state_dir)
        ray.train.get_checkpoint = lambda: start
        try:
            loop.train_loop_per_worker(config)
        finally:
            ray.train.get_checkpoint = own


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
            shutil.copy2(os.path.join(train_dir, checkpoint.STATE_FILE), directory)
        with open(os.path.join(directory, SOURCE_FILE), "w") as f:
            json.dump({"trial_id": trial_id, "epoch": metrics["epoch"], "segment": segment,
                       "train_checkpoint": ckpt.path, "metrics": metrics}, f)
        ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(directory))


# ---------------------------------------------------------------------------- placement groups


def _worker_group_callback_base():
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    return WorkerGroupCallback


class RecordPlacementGroup(_worker_group_callback_base()):
    """Train-controller callback: notes the controller (a line of ``placement_groups.jsonl``)
    before it creates a worker group's placement group, for ``PlacementGroupReaper``."""

    def __init__(self, path: str):
        self.path = path
        self.recorded = False

    def before_worker_group_start(self, worker_group_context) -> None:
        import ray

        if not self.recorded:  # once per controller: its restarts make new groups too
            _append_jsonl(self.path, {"controller": ray.get_runtime_context().get_actor_id()})
            self.recorded = True


class PlacementGroupReaper(report.Poller):
    """Driver thread: removes the placement groups a Train controller made once it is dead.

    Tune ends a trial (early stop, PBT pause or exploit, Ctrl-C) by ending the trial's process;
    the Train controller it owns dies with it and never removes its workers' placement group,
    and Ray keeps a group until the job that made it ends: the driver, here, which runs the
    whole search. Ray 2.60's PlacementGroupCleaner should remove it, but its state-API query
    fails when several Ray clusters run on one machine ("Found multiple active Ray instances"),
    and the leaked CPUs stall every later trial (seen here: 60 s worker-group timeouts; Ray
    issue #54305). And neither it nor a record written once a group has started knows of a
    group that never finished starting: a controller whose worker died first (Ctrl-C) retries,
    making a new group in its last moments (seen: one CPU held for the rest of the session, the
    trials of later searches then ran one at a time). So the groups are found by who made them
    (the GCS table), and only the controllers are recorded, before they make any.
    """

    def __init__(self, trials_dir: str, interval_s: float = 1.0):
        self.trials_dir, self.interval_s = trials_dir, interval_s

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        # Trials stopped last (ASHA at the final epoch) may still be dying: wait for them.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.sweep()
                if not self.pending():
                    return
            except Exception:  # noqa: BLE001 - e.g. Ray shut down under us (Ctrl-C)
                return
            time.sleep(0.5)

    def controllers(self) -> set[str]:
        if not os.path.isdir(self.trials_dir):
            return set()
        return {rec["controller"] for trial in sorted(os.listdir(self.trials_dir))
                for rec in report.read_jsonl(os.path.join(self.trials_dir, trial, PG_FILE))}

    def pending(self) -> list[str]:
        """The placement groups of this search's controllers that are not removed yet."""
        mine = self.controllers()
        return [pg for pg, creator, _ in live_placement_groups() if creator in mine]

    def poll(self) -> None:
        try:
            self.sweep()
        except Exception:  # noqa: BLE001 - a failed sweep is retried at the next tick
            pass

    def sweep(self) -> int:
        """Remove every placement group a dead controller of this search made; returns how
        many."""
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        mine = self.controllers()
        removed = 0
        for pg, creator, creator_dead in live_placement_groups():
            if creator in mine and creator_dead:
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg))))
                removed += 1
        return removed


def live_placement_groups() -> list[tuple[str, str, bool]]:
    """(id, creator actor id, whether that actor is dead) of each placement group not removed:
    the GCS table, which ``ray.util.placement_group_table`` shows without its creator."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = gcs_pb2.PlacementGroupTableData
    rows = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        pg = table.FromString(raw)
        if pg.state != table.REMOVED:
            rows.append((pg.placement_group_id.hex(), pg.creator_actor_id.hex(),
                         pg.creator_actor_dead))
    return rows


# ---------------------------------------------------------------------------- results


def summarize(cfg: TrainConfig, grid, wall_s: float) -> TuneSummary:
    """results.csv, tune.png and the best trial's model.pt from a finished (or stopped) search."""
    exp_dir = cfg.run_dir
    saved = saved_statuses(exp_dir)
    rows = [trial_row(cfg, trial, result, saved.get(trial.trial_id, trial.status))
            for trial, result in zip(_trials(grid), grid)]
    rows.sort(key=lambda r: r["trial_id"])
    write_csv(os.path.join(exp_dir, "results.csv"), rows)
    summary = TuneSummary(exp_dir, rows, cfg.optim.epochs, cfg.cluster.max_workers, wall_s,
                          None, None)
    summary.plot = plot(exp_dir, rows)
    best = summary.best
    if best and best["checkpoint"]:
        from ray.train import Checkpoint

        summary.model_path = launch.export_model(exp_dir, Checkpoint(best["checkpoint"]))
    return summary


def trial_row(cfg: TrainConfig, trial, result, tune_status: str) -> dict[str, Any]:
    trial_dir = os.path.join(cfg.run_dir, "trials", trial.trial_id)
    rows = report.read_metrics(trial_dir)
    reports = result.metrics_dataframe
    n_reports = 0 if reports is None or "epoch" not in reports else int(
        reports["epoch"].notna().sum())
    if cfg.tune.scheduler != "pbt" and rows:  # Tune forgets reports from before a restore
        n_reports = max(n_reports, rows[-1]["epoch"])
    error = ""
    if rows and "error" in rows[-1]:  # the loop's NaN stop
        status, error = "failed", rows[-1]["error"]
    elif tune_status == "ERROR":
        status, error = "failed", trial_error(trial.trial_id, cfg.run_dir, result.error)
    elif rows and rows[-1]["epoch"] >= cfg.optim.epochs:
        status = "completed"
    elif tune_status == "TERMINATED":
        status = "stopped"
    else:
        status = tune_status.lower()  # pending / running / paused: an interrupted search
    accs = [(r["test_acc"], r["epoch"]) for r in rows
            if isinstance(r.get("test_acc"), float) and math.isfinite(r["test_acc"])]
    best_acc, best_epoch = max(accs, default=("", ""))
    starts = report.read_jsonl(os.path.join(trial_dir, "starts.jsonl"))
    return {
        "trial_id": trial.trial_id, "lr": float(trial.config["lr"]),
        "batch_size": int(trial.config["batch_size"]), "status": status,
        "epochs_run": n_reports, "last_epoch": rows[-1]["epoch"] if rows else 0,
        "final_test_acc": rows[-1]["test_acc"] if rows else "",
        "best_test_acc": best_acc, "best_epoch": best_epoch,
        "checkpoint": best_checkpoint(reports),
        "started_from": ";".join(f"{s['from_trial']}@{s['from_epoch']}" for s in starts
                                 if s.get("from_trial") and s["from_trial"] != trial.trial_id),
        "error": error,
    }


def trial_error(trial_id: str, exp_dir: str | None, err: BaseException | None = None) -> str:
    """The one-line reason a trial failed: what the trial recorded, else Ray's error."""
    if exp_dir is not None:
        events = report.read_jsonl(os.path.join(exp_dir, "trials", trial_id, "events.jsonl"))
        failed = [e["error"] for e in events if e["event"] == "trial_failed"]
        if failed:
            return failed[-1]
    if err is None:
        return "see the trial's error.txt"
    text = launch._short(err)
    return text.removeprefix(f"{TrialFailed.__module__}.TrialFailed: ").removeprefix(
        "TrialFailed: ")


def best_checkpoint(reports) -> str:
    """The reported checkpoint with the best test_acc that is still on disk."""
    if reports is None or "checkpoint_path" not in reports or METRIC not in reports:
        return ""
    rows = reports.dropna(subset=["checkpoint_path", METRIC]).sort_values(
        METRIC, ascending=False, kind="stable")
    for path in rows["checkpoint_path"]:
        if os.path.exists(os.path.join(path, checkpoint.STATE_FILE)):
            return path
    return ""


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def read_results(exp_dir: str) -> list[dict[str, str]]:
    with open(os.path.join(exp_dir, "results.csv"), newline="") as f:
        return list(csv.DictReader(f))


def plot(exp_dir: str, rows: list[dict[str, Any]]) -> str | None:
    """tune.png: test accuracy vs epoch per trial; lr vs best test accuracy."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_curve, ax_lr) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted({r["batch_size"] for r in rows})
    colors = {b: plt.cm.viridis(i / max(len(sizes) - 1, 1)) for i, b in enumerate(sizes)}
    for r in rows:
        metrics = report.read_metrics(os.path.join(exp_dir, "trials", r["trial_id"]))
        style = {"failed": ":", "stopped": "--"}.get(r["status"], "-")
        ax_curve.plot([m["epoch"] for m in metrics], [m["test_acc"] for m in metrics], style,
                      marker=".", label=f"{r['trial_id'][-5:]} lr {r['lr']:.2g} b{r['batch_size']}")
        acc = r["best_test_acc"] if r["best_test_acc"] != "" else 0.0
        ax_lr.scatter(r["lr"], acc, color=colors[r["batch_size"]],
                      marker="x" if r["status"] == "failed" else "o", s=50)
    for b, color in colors.items():
        ax_lr.scatter([], [], color=color, label=f"batch {b}")
    ax_lr.scatter([], [], color="gray", marker="x", label="failed")
    ax_curve.set(xlabel="epoch", ylabel="test accuracy",
                 title="test accuracy per trial (dashed: stopped early)")
    ax_lr.set(xscale="log", xlabel="learning rate (global batch)", ylabel="best test accuracy",
              title="learning rate vs best test accuracy")
    for ax in (ax_curve, ax_lr):
        ax.grid(alpha=0.3)
    ax_curve.legend(fontsize=7, ncol=2)
    ax_lr.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.normpath(exp_dir)))
    fig.tight_layout()
    path = os.path.join(exp_dir, "tune.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_text(summary: TuneSummary) -> str:
    head = (f"{'trial':<12} {'lr':>9} {'batch':>5} {'status':<9} {'epochs':>6} "
            f"{'final_acc':>9} {'best_acc':>8}")
    lines = [head]
    for r in summary.rows:
        final = f"{r['final_test_acc']:.4f}" if r["final_test_acc"] != "" else "-"
        best = f"{r['best_test_acc']:.4f}" if r["best_test_acc"] != "" else "-"
        lines.append(f"{r['trial_id']:<12} {r['lr']:>9.3g} {r['batch_size']:>5} "
                     f"{r['status']:<9} {r['epochs_run']:>6} {final:>9} {best:>8}"
                     + (f"  from {r['started_from']}" if r["started_from"] else ""))
    for r in summary.rows:
        if r["status"] == "failed":
            lines.append(f"trial {r['trial_id']} failed: {r['error']}")
    most = len(summary.rows) * summary.epochs * summary.num_workers
    lines.append(f"worker-epochs spent: {summary.worker_epochs} of {most} for every trial "
                 f"to run all {summary.epochs} epochs; wall time {summary.wall_s:.1f}s")
    best = summary.best
    if best:
        lines.append(f"best: trial {best['trial_id']}: lr {best['lr']:.4g}, batch_size "
                     f"{best['batch_size']}: test_acc {best['best_test_acc']:.4f} at epoch "
                     f"{best['best_epoch']}")
        lines.append(f"best checkpoint: {best['checkpoint'] or '(none kept)'}")
    lines.append(f"results: {os.path.join(summary.exp_dir, 'results.csv')}"
                 + (f", plot: {summary.plot}" if summary.plot else ""))
    if summary.model_path:
        lines.append(f"weights: {summary.model_path}")
    return "\n".join(lines)


def print_summary(summary: TuneSummary) -> None:
    print()
    print(summary_text(summary))
