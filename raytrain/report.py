"""A run's files: metrics.jsonl/csv, events.jsonl, its summary table, epoch lines and plots.

``python -m raytrain.report RUN_DIR`` re-draws the plot and prints the summary of a run;
RUN_DIR may be a bucket URI (``s3://BUCKET/PREFIX/NAME``): its metrics are downloaded and the
plot is uploaded beside them. A --tune search's directory (results.csv, no metrics) gets its
trials table and best trial (each trial, ``NAME/trials/TRIAL_ID``, is a run of its own).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from raytrain import files, storage
from raytrain.errors import RaytrainError
from raytrain.files import EVENTS_FILE, METRICS_FILE

SEARCH_RESULTS = "results.csv"  # a --tune search's table (raytrain/tune/results.py)
METRICS = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "images_per_s",
           "epoch_s")


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    return files.read_jsonl(os.path.join(run_dir, METRICS_FILE))


def append_event(run_dir: str, event: dict[str, Any]) -> None:
    """Append one line to events.jsonl, or nothing (a full disk: see ``files.append_jsonl``)."""
    files.append_jsonl(os.path.join(run_dir, EVENTS_FILE), event)


def record_epoch(run_dir: str, metrics: dict[str, Any]) -> None:
    """Add one epoch to metrics.jsonl/.csv, replacing that epoch and any later one.

    A worker group restarted from the checkpoint of epoch k re-runs k+1..: the file keeps
    every epoch exactly once.
    """
    rows = [r for r in read_metrics(run_dir) if r["epoch"] < metrics["epoch"]] + [metrics]
    files.atomic_write(os.path.join(run_dir, METRICS_FILE), files.jsonl_text(rows))
    files.write_csv(os.path.join(run_dir, "metrics.csv"), METRICS, rows)


def startup_phases(started_at: float, driver: list[tuple[str, float]], row: dict[str, Any]
                   ) -> list[tuple[str, float]]:
    """Where the time to first step went: (phase, seconds), each ending at its mark. The
    driver's marks, then rank 0's (``loop.run_worker``) from an epoch row of this attempt."""
    worker = row.get("startup") or {}
    marks = driver + [("worker start", worker.get("process")),
                      ("worker setup", worker.get("loop")), ("data", worker.get("data")),
                      ("model", worker.get("model")), ("first step", row["first_step_at"])]
    phases, last = [], started_at
    for name, at in marks:
        if at:  # rank 0's process may predate the trainer: prestarted (driver.cluster)
            phases.append((name, max(0.0, at - last)))
            last = max(at, last)
    return phases


def epoch_line(m: dict[str, Any], epochs: int, eta_s: float | None = None) -> str:
    eta = "" if eta_s is None else f"  ETA {int(eta_s) // 60}:{int(eta_s) % 60:02d}"
    return (f"epoch {m['epoch']:>3}/{epochs}  train_loss {m['train_loss']:.4f}  "
            f"train_acc {m['train_acc']:.4f}  test_loss {m['test_loss']:.4f}  "
            f"test_acc {m['test_acc']:.4f}  lr {m['lr']:.2e}  "
            f"{m['images_per_s']:,.0f} img/s  {m['epoch_s']:.1f}s{eta}")


def summary_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'epoch':>5} {'train_loss':>10} {'train_acc':>9} {'test_loss':>9} " \
           f"{'test_acc':>8} {'img/s':>9} {'epoch_s':>7}"
    lines = [head] + [
        f"{r['epoch']:>5} {r['train_loss']:>10.4f} {r['train_acc']:>9.4f} "
        f"{r['test_loss']:>9.4f} {r['test_acc']:>8.4f} {r['images_per_s']:>9,.0f} "
        f"{r['epoch_s']:>7.2f}" for r in rows]
    return "\n".join(lines)


def best_key(row: dict[str, Any]) -> tuple[float, int]:
    """The one order of "best" epochs: highest test_acc, the latest of equals (the one Ray
    Train keeps: its checkpoint manager ranks a later checkpoint above an equal earlier one)."""
    return row["test_acc"], row["epoch"]


def accuracy_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The final and best test accuracy, then the seed scripts' own closing line."""
    final = rows[-1]
    best = max(rows, key=best_key)
    lines = [f"final test_acc {final['test_acc']:.4f} (best {best['test_acc']:.4f} at epoch "
             f"{best['epoch']}), test_loss {final['test_loss']:.4f}"]
    if final.get("test_count"):
        lines.append("Accuracy of the network on the %d test images: %.2f %%"
                     % (final["test_count"], 100 * final["test_acc"]))
    return lines


def _acc(value: Any) -> str:
    return "-" if value in ("", None) else f"{float(value):.4f}"


def search_table(rows: list[dict[str, Any]]) -> list[str]:
    """A search's trials, one line each, then a line per failed trial. ``rows``: results.csv's
    (as written, or read back as strings)."""
    lines = [f"{'trial':<12} {'lr':>9} {'batch':>5} {'status':<9} {'epochs':>6} "
             f"{'final_acc':>9} {'best_acc':>8}"]
    for r in rows:
        lines.append(f"{r['trial_id']:<12} {float(r['lr']):>9.3g} {r['batch_size']:>5} "
                     f"{r['status']:<9} {r['epochs_run']:>6} {_acc(r['final_test_acc']):>9} "
                     f"{_acc(r['best_test_acc']):>8}"
                     + (f"  from {r['started_from']}" if r["started_from"] else ""))
    return lines + [f"trial {r['trial_id']} failed: {r['error']}" for r in rows
                    if r["status"] == "failed"]


def best_trial(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The trial of the best test_acc that did not fail (results.csv's rows)."""
    ok = [r for r in rows if r["status"] != "failed" and r["best_test_acc"] != ""]
    return max(ok, key=lambda r: float(r["best_test_acc"]), default=None)


def best_trial_lines(rows: list[dict[str, Any]]) -> list[str]:
    best = best_trial(rows)
    if best is None:
        return []
    return [f"best: trial {best['trial_id']}: lr {float(best['lr']):.4g}, batch_size "
            f"{best['batch_size']}: test_acc {float(best['best_test_acc']):.4f} at epoch "
            f"{best['best_epoch']}",
            f"best checkpoint: {best['checkpoint'] or '(none kept)'}"]


def plot_curves(run_dir: str, rows: list[dict[str, Any]]) -> str | None:
    """learning_curves.png: loss and accuracy vs epoch, train and test."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for split in ("train", "test"):
        ax_loss.plot(epochs, [r[f"{split}_loss"] for r in rows], marker="o", label=split)
        ax_acc.plot(epochs, [r[f"{split}_acc"] for r in rows], marker="o", label=split)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, run_dir, "learning_curves.png")


def save_figure(fig, run_dir: str, name: str) -> str:
    """``fig``, titled with the run's name, as ``run_dir/name``; returns its path."""
    import matplotlib.pyplot as plt

    fig.suptitle(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    path = os.path.join(run_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m raytrain.report",
                                     description="Summarise a finished run and re-draw plots.")
    parser.add_argument("run_dir", help="a run directory or its bucket URI")
    args = parser.parse_args(argv)
    if storage.is_uri(args.run_dir):
        return _main_uri(args.run_dir)
    rows = read_metrics(args.run_dir)
    if not rows and os.path.exists(os.path.join(args.run_dir, SEARCH_RESULTS)):
        return _search(args.run_dir, args.run_dir)
    if not rows:
        print(f"raytrain: error: {args.run_dir}: no metrics.jsonl", file=sys.stderr)
        return 2
    print(summary_table(rows))
    print("\n".join(accuracy_lines(rows)))
    print(f"plot: {plot_curves(args.run_dir, rows)}")
    return 0


def _main_uri(uri: str) -> int:
    """report on a run in a bucket: metrics downloaded to a temporary directory, the plot
    drawn there and uploaded beside them."""
    import tempfile

    uri = uri.rstrip("/")
    with tempfile.TemporaryDirectory(prefix="raytrain-report-") as tmp:
        local = os.path.join(tmp, os.path.basename(uri))
        try:
            storage.download(uri, local, (METRICS_FILE, SEARCH_RESULTS))
        except OSError as err:
            raise RaytrainError(f"{uri}: cannot read it ({storage.first_line(err)})") from None
        rows = read_metrics(local)
        if not rows and os.path.exists(os.path.join(local, SEARCH_RESULTS)):
            return _search(local, uri)
        if not rows:
            raise RaytrainError(f"{uri}: no metrics.jsonl")
        print(summary_table(rows))
        print("\n".join(accuracy_lines(rows)))
        plot_curves(local, rows)
        try:
            storage.upload(local, uri, ("learning_curves.png",))
        except storage.UploadError as err:
            raise RaytrainError(str(err)) from None
    print(f"plot: {storage.join(uri, 'learning_curves.png')}")
    return 0


def _search(local: str, where: str) -> int:
    """report on a search: its trials from results.csv (``local``), the files at ``where``."""
    rows = files.read_csv(os.path.join(local, SEARCH_RESULTS))
    print("\n".join(search_table(rows) + best_trial_lines(rows)))
    print(f"results: {storage.join(where, SEARCH_RESULTS)}, plot: "
          f"{storage.join(where, 'tune.png')}; a trial's curves: python -m raytrain.report "
          f"{storage.join(where, 'trials', 'TRIAL_ID')}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RaytrainError as err:
        print(f"raytrain: error: {err}", file=sys.stderr)
        sys.exit(2)
