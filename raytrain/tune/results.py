"""A search's results: results.csv, tune.png, the best trial's model.pt, the summary.

    from raytrain.tune.results import read_results
    rows = read_results("runs/my-search")
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from raytrain import files, ray_compat, report, storage
from raytrain.config import TrainConfig
from raytrain.driver.run import export_model
from raytrain.errors import TrainingError, short
from raytrain.files import EVENTS_FILE
from raytrain.tune.trial import TrialFailed, pull_trials

METRIC, MODE = "test_acc", "max"


# A search's own files on a bucket, uploaded from the driver's mirror (model.pt last).
SEARCH_FILES = ("config.yaml", "mlflow_run_id", "results.csv", "tune.png", "model.pt")

RESULT_COLUMNS = ("trial_id", "lr", "batch_size", "status", "epochs_run", "last_epoch",
                  "final_test_acc", "best_test_acc", "best_epoch", "checkpoint",
                  "started_from", "error")


@dataclass
class TuneSummary:
    exp_dir: str  # where the search lives: a path or a bucket URI
    rows: list[dict[str, Any]]
    epochs: int
    num_workers: int
    wall_s: float
    plot: str | None
    model_path: str | None

    @property
    def best(self) -> dict[str, Any] | None:
        return report.best_trial(self.rows)

    @property
    def worker_epochs(self) -> int:
        """Compute spent: epochs trained over all trials x workers per trial."""
        return sum(r["epochs_run"] for r in self.rows) * self.num_workers


def _trials(grid) -> list:
    return ray_compat.result_grid_trials(grid)


def saved_statuses(location: str) -> dict[str, str]:
    """Trial statuses as Tune saved them (at ``location``, a path or a bucket URI). After
    Ctrl-C, Tune saves the experiment and then marks every trial in memory TERMINATED; the
    saved state still says which were unfinished (and a re-run resumes those)."""
    from ray.tune import ExperimentAnalysis

    try:
        return {t.trial_id: t.status for t in ExperimentAnalysis(location).trials}
    except Exception:  # noqa: BLE001 - no saved state: the in-memory statuses stand
        return {}


def summarize(cfg: TrainConfig, grid, wall_s: float) -> TuneSummary:
    """results.csv, tune.png and the best trial's model.pt from a finished (or stopped) search.
    On a bucket: every trial's files are synced with the mirror first (``trial.pull_trials``:
    trials on other nodes wrote theirs in their own node's mirror), the best weights come from
    its checkpoint in the bucket, and the search's files are uploaded."""
    exp_dir, location = cfg.run_dir, cfg.run_location
    on_bucket = storage.is_uri(location)
    if on_bucket:
        _storage_step("sync", location, lambda: pull_trials(location, exp_dir))
    saved = saved_statuses(location)
    rows = [trial_row(cfg, trial, result, saved.get(trial.trial_id, trial.status))
            for trial, result in zip(_trials(grid), grid)]
    rows.sort(key=lambda r: r["trial_id"])
    write_csv(os.path.join(exp_dir, "results.csv"), rows)
    summary = TuneSummary(location, rows, cfg.optim.epochs, cfg.cluster.max_workers, wall_s,
                          None, None)
    summary.plot = plot(exp_dir, rows)
    best = summary.best
    if best and best["checkpoint"]:
        from ray.train import Checkpoint

        summary.model_path = export_model(exp_dir, Checkpoint(best["checkpoint"]))
    if on_bucket:
        _storage_step("write", location, lambda: storage.upload(exp_dir, location,
                                                                SEARCH_FILES))
        summary.plot = summary.plot and storage.join(location, "tune.png")
        summary.model_path = summary.model_path and storage.join(location, "model.pt")
    return summary


def _storage_step(what: str, location: str, step) -> None:
    """``step()``; a bucket that fails it is one TrainingError naming ``location``."""
    try:
        step()
    except OSError as err:
        raise TrainingError(f"--storage-path: cannot {what} {location} "
                            f"({storage.first_line(err)}); the trials' checkpoints are kept: "
                            "rerun the same command") from None


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
    elif tune_status == "ERROR" or (tune_status in ("RUNNING", "PENDING") and failed_events(
            trial_dir)):  # Tune never finishes stopping a trial whose node was lost
        status, error = "failed", trial_error(trial.trial_id, cfg.run_dir, result.error)
    elif rows and rows[-1]["epoch"] >= cfg.optim.epochs:
        status = "completed"
    elif tune_status == "TERMINATED":
        status = "stopped"
    else:
        status = tune_status.lower()  # pending / running / paused: an interrupted search
    best_acc, best_epoch = max((report.best_key(r) for r in rows if isinstance(
        r.get("test_acc"), float) and math.isfinite(r["test_acc"])), default=("", ""))
    starts = files.read_jsonl(os.path.join(trial_dir, "starts.jsonl"))
    return {
        "trial_id": trial.trial_id, "lr": float(trial.config["lr"]),
        "batch_size": int(trial.config["batch_size"]), "status": status,
        "epochs_run": n_reports, "last_epoch": rows[-1]["epoch"] if rows else 0,
        "final_test_acc": rows[-1]["test_acc"] if rows else "",
        "best_test_acc": best_acc, "best_epoch": best_epoch,
        "checkpoint": best_checkpoint(reports, cfg.run_location) or unreported_checkpoint(
            cfg.run_location, trial.trial_id, starts, best_epoch),
        "started_from": ";".join(f"{s['from_trial']}@{s['from_epoch']}" for s in starts
                                 if s.get("from_trial") and s["from_trial"] != trial.trial_id),
        "error": error,
    }


def failed_events(trial_dir: str) -> list[str]:
    """The reasons recorded by ``search.Progress`` each time Tune marked the trial failed."""
    return [e["error"] for e in files.read_jsonl(os.path.join(trial_dir, EVENTS_FILE))
            if e["event"] == "trial_failed"]


def trial_error(trial_id: str, exp_dir: str | None, err: BaseException | None = None) -> str:
    """The one-line reason a trial failed: what the trial recorded, else Ray's error."""
    if exp_dir is not None:
        failed = failed_events(os.path.join(exp_dir, "trials", trial_id))
        if failed:
            return failed[-1]
    if err is None:
        return "see the trial's error.txt"
    text = short(err)
    return text.removeprefix(f"{TrialFailed.__module__}.TrialFailed: ").removeprefix(
        "TrialFailed: ")


def best_checkpoint(reports, location: str = "") -> str:
    """The reported checkpoint of the best epoch (``report.best_key``) still in storage: a path,
    or for a search at a bucket ``location`` a URI."""
    if reports is None or "checkpoint_path" not in reports or METRIC not in reports:
        return ""
    rows = reports.dropna(subset=["checkpoint_path", METRIC]).to_dict("records")
    for row in sorted(rows, key=report.best_key, reverse=True):
        path = checkpoint_uri(row["checkpoint_path"], location)
        if storage.exists(storage.join(path, files.STATE_FILE)):
            return path
    return ""


def unreported_checkpoint(location: str, trial_id: str, starts: list[dict[str, Any]],
                          epoch: int | str) -> str:
    """The checkpoint of ``epoch`` in the trial's latest Train run, for a trial whose reports
    of it never reached Tune (its last epochs ran on while Ctrl-C stopped the search; the
    re-run found nothing left to train), or ""."""
    if not starts or epoch == "":
        return ""
    path = storage.join(location, "trials", trial_id, starts[-1]["segment"],
                        f"checkpoint_epoch_{int(epoch):04d}")
    return path if storage.exists(storage.join(path, files.STATE_FILE)) else ""


def checkpoint_uri(path: str, location: str) -> str:
    """Ray reports a checkpoint on a bucket as a path in its file system (``BUCKET/KEY``):
    the URI of it, with the scheme of the search's ``location``."""
    if storage.is_uri(location) and "://" not in path:
        return f"{storage.scheme(location)}://{path.lstrip('/')}"
    return path


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    files.write_csv(path, RESULT_COLUMNS, rows)


def read_results(exp_dir: str) -> list[dict[str, str]]:
    return files.read_csv(os.path.join(exp_dir, "results.csv"))


def plot(exp_dir: str, rows: list[dict[str, Any]]) -> str | None:
    """tune.png: test accuracy vs epoch per trial; lr vs best test accuracy."""
    if not rows:
        return None
    return report.save_figure(figure(exp_dir, rows), exp_dir, "tune.png")


def figure(exp_dir: str, rows: list[dict[str, Any]]):
    """The matplotlib figure of tune.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
    if any(r["status"] == "failed" for r in rows):
        ax_lr.scatter([], [], color="gray", marker="x", label="failed")
    ax_curve.set(xlabel="epoch", ylabel="test accuracy",
                 title="test accuracy per trial (dashed: stopped early)")
    ax_curve.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    ax_lr.set(xscale="log", xlabel="learning rate (global batch)", ylabel="best test accuracy",
              title="learning rate vs best test accuracy")
    for ax in (ax_curve, ax_lr):
        ax.grid(alpha=0.3)
    ax_curve.legend(fontsize=7, ncol=2)
    ax_lr.legend(fontsize=8)
    return fig


def summary_text(summary: TuneSummary) -> str:
    lines = report.search_table(summary.rows)
    most = len(summary.rows) * summary.epochs * summary.num_workers
    lines.append(f"worker-epochs spent: {summary.worker_epochs} of {most} for every trial "
                 f"to run all {summary.epochs} epochs; wall time {summary.wall_s:.1f}s")
    lines += report.best_trial_lines(summary.rows)
    lines.append(f"results: {storage.join(summary.exp_dir, 'results.csv')}"
                 + (f", plot: {summary.plot}" if summary.plot else ""))
    if summary.model_path:
        lines.append(f"weights: {summary.model_path}")
    return "\n".join(lines)


def print_summary(summary: TuneSummary) -> None:
    print()
    print(summary_text(summary))

