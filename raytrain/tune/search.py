"""The Tune layer: many trainings searching lr and batch size, weak ones stopped early.

    python -m raytrain.fit --tune --num-samples 8 --num-workers 1 --dataset digits --epochs 10
    python -m raytrain.fit --tune --num-samples 8 --storage-path s3://BUCKET/searches --name s1

Train V2 has no ``Tuner(trainer)``: a Tune trial is ``run_trial``, a function that builds the
same TorchTrainer as a plain run (``driver.run.build_trainer``; ``trial.run_trial``) with the trial's lr and batch size
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

A search on a bucket (``--storage-path s3://BUCKET/PREFIX``, also gs://): Tune keeps its state
and ``tune-TRIAL_ID/`` there (``RunConfig(storage_path=URI)``; a re-run restores from the URI);
raytrain's files above are written in the driver's mirror of ``URI/NAME``
(``storage.mirror_of``) and uploaded. Before a search starts the mirror is re-made from the
bucket (``pull_search``: name reuse is checked against the bucket; --fresh deletes the search
there). Each trial writes its files in its own node's mirror of ``URI/NAME/trials/TRIAL_ID``
and uploads them after every epoch; its checkpoints go to the bucket through Ray Train. Before
summing up, the driver syncs every trial's files into its mirror (``trial.pull_trials``) and
takes ``model.pt`` from the best checkpoint in the bucket. What reads trial files while the
search runs (``PlacementGroupReaper``, MLflow's ``SearchTracker``) sees the trials on the
driver's node only. PBT is refused with a bucket (``config.check_search``).

PBT: see ``raytrain.tune.pbt``.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from typing import Any

import yaml

from raytrain import files, ray_compat, report, storage
from raytrain.config import TrainConfig, check_search
from raytrain.driver import nodes, preflight
from raytrain.driver.tracking import SearchTracker
from raytrain.driver.run import NOT_TRAINING
from raytrain.errors import Interrupted, RaytrainError, TrainingError
from raytrain.tune.asha import RUNG_METRIC, RUNG_MODE, LateCheckASHA
from raytrain.tune.placement import PlacementGroupReaper
from raytrain.tune.results import METRIC, MODE, TuneSummary, summarize, trial_error
from raytrain.tune.trial import pull_trials, run_trial

# Tune refuses an all-zero request; a trial only waits on its TorchTrainer, whose controller is
# a num_cpus=0 actor too. A byte of memory instead of a "sliver of CPU" keeps CPU accounting
# whole: with {"CPU": 0.01}, two 1-CPU trials on 2 CPUs would need 2.02 and one would stall.
TRIAL_RESOURCES = {"CPU": 0, "memory": 1}


# Settings a resumed search may change (they do not change what the trials train).
NOT_SEARCH = NOT_TRAINING - {"num_workers", "cpus_per_worker"} | {
    "max_concurrent_trials"}


def run(cfg: TrainConfig, started_at: float, resume: bool = False, fresh: bool = False
        ) -> TuneSummary:
    """Run (or resume) the search on the connected cluster and write its result files."""
    from ray import tune

    check(cfg)
    shape = preflight.preflight(cfg)
    exp_dir, location = cfg.run_dir, cfg.run_location  # the same, or the mirror and the URI
    base = prepare_exp_dir(cfg, resume, fresh)
    reap = ray_compat.can_reap_placement_groups()
    trainable = tune.with_resources(tune.with_parameters(
        run_trial, base=base, shape=shape, reap=reap), TRIAL_RESOURCES)
    concurrent = cfg.tune.max_concurrent_trials or placeable_trials(cfg, shape.use_gpu)
    if tune.Tuner.can_restore(location):
        print(f"resuming the search in {location} (finished trials are kept)", flush=True)
        tuner = tune.Tuner.restore(location, trainable=trainable)
    else:
        print(f"tuning: {describe(cfg, concurrent)}", flush=True)
        tuner = tune.Tuner(trainable, param_space=search_space(cfg),
                           tune_config=tune_config(cfg, concurrent),
                           run_config=run_config(cfg))
    if not cfg.run.verbose:  # Tune's reporter prints its boxed settings table and a
        # TensorBoard hint into /tmp/ray/session_* even at verbose=0; the legacy one is silent
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # MLflow (--mlflow-uri): a parent run, a child per trial, fed from the trials' files
    with SearchTracker(cfg) as tracker:
        with PlacementGroupReaper(os.path.join(exp_dir, "trials"), enabled=reap), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*reuse_actors")  # PBT: we restart trials
            grid = tuner.fit()
        summary = summarize(cfg, grid, time.time() - started_at)
        unfinished = [r for r in summary.rows if r["status"] in ("pending", "running", "paused")]
        if unfinished:
            raise Interrupted(f"search interrupted with {len(unfinished)} trial(s) "
                              "unfinished; rerun the same command to resume it")
        if summary.best is None:
            reasons = "; ".join(f"{r['trial_id']}: {r['error']}" for r in summary.rows)
            raise TrainingError(f"all {len(summary.rows)} trials failed ({reasons[:400]})")
        tracker.finish("FINISHED", trial_statuses={r["trial_id"]: r["status"]
                                                   for r in summary.rows},
                       metrics={"best_test_acc": summary.best["best_test_acc"],
                                "worker_epochs": summary.worker_epochs})
    return summary


check = check_search  # the cross-section checks: in config.py, with all the others


def prepare_exp_dir(cfg: TrainConfig, resume: bool, fresh: bool) -> dict[str, Any]:
    """Create or re-open STORAGE/NAME; returns the flat config every trial starts from. A
    search on a bucket: the mirror is made from the bucket first (``pull_search``), and
    --fresh deletes the search there."""
    exp_dir = cfg.run_dir
    if storage.is_uri(cfg.run_location):
        pull_search(cfg, fresh)
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
    files.atomic_write(saved_path, yaml.safe_dump(flat, sort_keys=False))
    try:
        if storage.is_uri(cfg.run_location):
            storage.upload(exp_dir, cfg.run_location, ("config.yaml",))
    except storage.UploadError as err:
        raise RaytrainError(f"--storage-path {cfg.run.storage_path}: {err}") from None
    # Trials run in their own working directory: hand them absolute paths.
    for key in ("data_dir", "pretrained"):
        if flat.get(key):
            flat[key] = os.path.abspath(flat[key])
    return flat


def pull_search(cfg: TrainConfig, fresh: bool) -> None:
    """The mirror of a search on a bucket made from the bucket (the truth): its config and
    MLflow run id, and every trial's files; with --fresh, the search deleted there instead."""
    location = cfg.run_location
    try:
        if fresh:
            storage.delete_dir(location)
            return
        storage.pull(location, cfg.run_dir)
        pull_trials(location, cfg.run_dir)
    except OSError as err:
        flag = "--fresh" if fresh else f"--storage-path {cfg.run.storage_path}"
        raise RaytrainError(f"{flag}: cannot {'delete' if fresh else 'read'} {location} "
                            f"({storage.first_line(err)})") from None


def placeable_trials(cfg: TrainConfig, use_gpu: bool) -> int:
    """How many trials' worker groups the cluster can hold at once (at least 1)."""
    import ray

    c = cfg.cluster
    need = {"CPU": c.worker_cpus} | ({"GPU": 1.0} if use_gpu else {})
    workers = sum(preflight.fits(n["Resources"], need) for n in ray.nodes() if n.get("Alive"))
    trials = workers // c.max_workers
    if cfg.data.streaming:  # each trial streams through its own pipeline: its data CPUs too
        per_trial = c.max_workers * c.worker_cpus + (cfg.data.data_cpus or 1.0)
        trials = min(trials, int(ray.cluster_resources().get("CPU", 0) // per_trial))
    return max(1, trials)


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
                           # Ray 2.60 cannot reuse a function trial's process: "Trainable
                           # runner reuse requires reset_config()" failed trials when tried.
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


def run_config(cfg: TrainConfig):
    from ray import tune

    return tune.RunConfig(
        name=cfg.run.name, storage_path=cfg.run.storage_path,
        # A failed trial is recorded and the search goes on; it is not retried.
        failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
        # Tune checkpoints (PBT only: one per perturbation interval) are all kept: with a
        # num_to_keep, Tune 2.60 logged errors deleting checkpoints of exploited trials.
        checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
        callbacks=[Progress(cfg.run_dir, cfg.optim.epochs, cfg.run_location)],
        verbose=1 if cfg.run.verbose else 0)


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


def _local_error(trial):
    """The error Tune has just written beside the trial on the driver (its copy in storage,
    which get_pickled_error reads, is synced later): the exception, or None."""
    path = getattr(trial, "pickled_error_file", None)
    if not path or not os.path.exists(path):
        return None
    import cloudpickle

    with open(path, "rb") as f:
        return cloudpickle.load(f)


def _tune_dirname(trial) -> str:
    return f"tune-{trial.trial_id}"


def _progress_base():
    from ray.tune import Callback

    return Callback


class Progress(_progress_base()):
    """Tune callback on the driver: one line when a trial starts, ends or fails."""

    def __init__(self, exp_dir: str, epochs: int, location: str | None = None):
        self.exp_dir, self.epochs = exp_dir, epochs
        self.location = location or exp_dir

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
        """Only a trial Tune marks ERROR failed: its reason goes into its events.jsonl."""
        try:
            err = trial.get_pickled_error() or trial.get_error() or _local_error(trial)
        except Exception:  # noqa: BLE001 - no error file: Ray's short reason stands
            err = None
        # A trial whose actor was on a lost node: Ray says "actor unavailable" (the GCS has
        # not marked the node dead yet); name the node instead.
        reason = nodes.lost_actor_node(err) or trial_error(trial.trial_id, None, err)
        try:
            self.record_failure(trial.trial_id, reason)
        except OSError:  # a full disk, a failing bucket: the line below still says it
            pass
        print(f"trial {trial.trial_id} failed: {reason}", flush=True)

    def record_failure(self, trial_id: str, reason: str) -> None:
        """A ``trial_failed`` line in the trial's events.jsonl; on a bucket, appended to the
        copy there (the trial, maybe on another node, uploaded its own last) and uploaded."""
        trial_dir = os.path.join(self.exp_dir, "trials", trial_id)
        location = storage.join(self.location, "trials", trial_id)
        if storage.is_uri(location):
            storage.pull_newer(location, trial_dir, (files.EVENTS_FILE,))
        report.append_event(trial_dir, {"event": "trial_failed", "error": reason,
                                        "time": time.time()})
        if storage.is_uri(location):
            storage.upload(trial_dir, location, (files.EVENTS_FILE,))
