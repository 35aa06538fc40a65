"""What each recipe flag does to the digits test accuracy: the per-worker loop in one process
(no Ray: the same step a Ray worker runs), the same run with one flag changed, several seeds.

    python benchmarks/recipe_effects.py                    # seed-cnn, 30 epochs, seeds 0-2
    python benchmarks/recipe_effects.py --model lenet --epochs 15
    python benchmarks/recipe_effects.py --quick            # smoke: 1 epoch, 1 seed, 2 settings

Prints final test_acc per seed, their mean, and the mean wall time of a run, one row per
setting; the first row is raytrain's defaults (batch 128, onecycle lr 0.05, SGD momentum 0.9,
weight decay 5e-4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain.config import TrainConfig  # noqa: E402
from raytrain.worker.loop import Worker, run_worker  # noqa: E402

SETTINGS = {
    "defaults": {},
    "--label-smoothing 0.1": {"label_smoothing": 0.1},
    "--mixup 0.2": {"mixup": 0.2},
    "--cutmix 1.0": {"cutmix": 1.0},
    "--ema 0.99": {"ema": 0.99},
    "--warmup-epochs 2": {"warmup_epochs": 2},
    "--grad-accum 2": {"grad_accum": 2},
    "--clip-grad 1.0": {"clip_grad": 1.0},
}


def final(flat: dict) -> tuple[float, float, float | None]:
    """(final test_acc, wall seconds, final test_acc_ema or None) of one run."""
    rows = []
    start = time.perf_counter()
    run_worker(TrainConfig.from_flat(flat), Worker(0, 0, 1, torch.device("cpu")),
               lambda m, s: rows.append(m))
    return rows[-1]["test_acc"], time.perf_counter() - start, rows[-1].get("test_acc_ema")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="seed-cnn")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a worker's share)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    settings = SETTINGS
    if a.quick:
        a.epochs, a.seeds, a.model = 2, "0", "lenet"
        settings = {k: SETTINGS[k] for k in ("defaults", "--ema 0.99")}
    torch.set_num_threads(a.threads)
    seeds = [int(s) for s in a.seeds.split(",")]
    print(f"digits, --model {a.model}, {a.epochs} epochs, 1 process x {a.threads} thread(s), "
          f"seeds {a.seeds}; final test_acc")
    print(f"{'setting':24s} " + " ".join(f"{'seed ' + str(s):>7s}" for s in seeds)
          + f" {'mean':>7s} {'s/run':>6s}")
    for name, flags in settings.items():
        accs, walls, emas = [], [], []
        for seed in seeds:
            acc, wall, ema = final({"dataset": "digits", "num_workers": 1, "model": a.model,
                                    "epochs": a.epochs, "seed": seed, **flags})
            accs.append(acc)
            walls.append(wall)
            if ema is not None:
                emas.append(ema)
        extra = f"  (EMA weights: mean {statistics.mean(emas):.4f})" if emas else ""
        print(f"{name:24s} " + " ".join(f"{v:7.4f}" for v in accs)
              + f" {statistics.mean(accs):7.4f} {statistics.mean(walls):6.1f}" + extra,
              flush=True)


if __name__ == "__main__":
    main()
