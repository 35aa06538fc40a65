"""Replay measured learning curves through Ray's own ASHA bracket: which rung metric, grace
period and reduction factor would have stopped what, without training anything again.

    python benchmarks/tune_asha_vs_none.py --seeds 0,1,2,3 --out-dir D   # makes D/none-seedN
    python benchmarks/asha_replay.py --quick    # smoke test on made-up curves
    python benchmarks/asha_replay.py D/none-seed0 D/none-seed1 D/none-seed2 D/none-seed3

Each argument is a finished ``--scheduler none`` search (every trial ran every epoch). Trials
start in trial-id order on ``--slots`` trial slots (what the cluster ran at once); a trial's
epochs take its measured ``epoch_s`` plus ``--report-s``, its start ``--startup-s``. Each
report goes through ``ray.tune.schedulers.async_hyperband._Bracket.on_result``, the decision
Ray's ASHAScheduler makes. Printed per search: worker-epochs spent as a share of running
every trial to the end, and how many test_acc points the best trial left running is behind
the best of all. Targets (issue #4): <= 40% and <= 0.5 points. With the late check raytrain
adds (``raytrain.tune.LateCheckASHA``) unless --no-late-check.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import os

from ray.tune.schedulers.trial_scheduler import TrialScheduler

from raytrain import ray_compat
from raytrain.tune import fell_behind


class _Trial:
    def __init__(self, trial_id):
        self.trial_id = trial_id


def load(exp_dir: str) -> list[list[dict]]:
    """Per trial (in trial-id order), its metrics.jsonl rows."""
    with open(os.path.join(exp_dir, "results.csv"), newline="") as f:
        ids = sorted(r["trial_id"] for r in csv.DictReader(f))
    curves = []
    for trial_id in ids:
        with open(os.path.join(exp_dir, "trials", trial_id, "metrics.jsonl")) as f:
            curves.append([json.loads(line) for line in f if line.strip()])
    return curves


def made_up_curves(trials: int = 6, epochs: int = 4) -> list[list[dict]]:
    """Curves shaped like a search's: trial i learns at rate (i + 1) / trials."""
    return [[{"epoch": e, "epoch_s": 1.0, "test_loss": 2.3 / (1 + e * (i + 1) / trials),
              "test_acc": 0.1 + 0.8 * (1 - 1 / (1 + e * (i + 1) / trials))}
             for e in range(1, epochs + 1)] for i in range(trials)]


def replay(curves, metric: str, rf: int, grace: int, slots: int, startup_s: float,
           report_s: float, late_check: bool = True, stagger_s: float = 0.0
           ) -> tuple[float, float]:
    """(share of worker-epochs spent, test_acc points behind the full search's best)."""
    epochs = min(len(c) for c in curves)
    bracket = ray_compat.asha_bracket(grace, epochs, rf)
    sign = -1 if metric.endswith("loss") else 1  # ASHAScheduler(mode="min") negates
    waiting, events, spent = list(range(len(curves))), [], {}

    def schedule(i: int, epoch: int, now: float) -> None:
        heapq.heappush(events, (now + curves[i][epoch - 1]["epoch_s"] + report_s, i, epoch))

    for slot in range(slots):  # the first trials start together, each a little later
        if waiting:
            schedule(waiting.pop(0), 1, startup_s + slot * stagger_s)
    while events:
        now, i, epoch = heapq.heappop(events)
        spent[i] = epoch
        action = bracket.on_result(_Trial(i), epoch, sign * curves[i][epoch - 1][metric])
        if late_check and action == TrialScheduler.CONTINUE and fell_behind(bracket._rungs, bracket.cutoff, i, epoch):
            action = TrialScheduler.STOP
        if action == TrialScheduler.STOP or epoch >= epochs:
            if waiting:
                schedule(waiting.pop(0), 1, now + startup_s)
        else:
            schedule(i, epoch + 1, now)
    best_all = max(r["test_acc"] for c in curves for r in c)
    best_kept = max(r["test_acc"] for i, n in spent.items() for r in curves[i][:n])
    return sum(spent.values()) / (epochs * len(curves)), (best_all - best_kept) * 100


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("searches", nargs="*", help="finished --scheduler none search directories")
    p.add_argument("--metrics", default="test_acc,test_loss")
    p.add_argument("--reduction-factors", default="2,3,4")
    p.add_argument("--grace-periods", default="1,2,4")
    p.add_argument("--slots", type=int, default=2, help="trials at once")
    p.add_argument("--startup-s", type=float, default=8.0)
    p.add_argument("--report-s", type=float, default=0.3)
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="each of the first --slots trials starts this much after the one before")
    p.add_argument("--first", type=int, default=0, help="start trial N first (who wins the "
                   "race to the first rungs among the first --slots trials)")
    p.add_argument("--no-late-check", dest="late_check", action="store_false",
                   help="Ray's ASHA alone, without raytrain's late check")
    p.add_argument("--quick", action="store_true", help="a smoke test on made-up curves "
                   "(6 trials x 4 epochs), rung metric test_loss, rf 2, grace 1")
    args = p.parse_args()
    if args.quick:
        args.searches, args.metrics, args.reduction_factors, args.grace_periods = \
            ["made-up"], "test_loss", "2", "1"
    elif not args.searches:
        p.error("give at least one search directory (or --quick)")
    searches = [made_up_curves() if args.quick else load(d) for d in args.searches]
    searches = [c[args.first:args.first + 1] + c[:args.first] + c[args.first + 1:]
                for c in searches]
    print(f"{'rung metric':<11} {'rf':>2} {'grace':>5}  " + "  ".join(
        f"{os.path.basename(os.path.normpath(d)):>16}" for d in args.searches) + "  all")
    for metric in args.metrics.split(","):
        for rf in map(int, args.reduction_factors.split(",")):
            for grace in map(int, args.grace_periods.split(",")):
                out = [replay(c, metric, rf, grace, args.slots, args.startup_s, args.report_s,
                              args.late_check, args.stagger_s) for c in searches]
                mean = sum(share for share, _ in out) / len(out)
                print(f"{metric:<11} {rf:>2} {grace:>5}  " + "  ".join(
                    f"{share:>6.0%} {gap:>+5.2f}pt" for share, gap in out) + f"  {mean:.0%}")


if __name__ == "__main__":
    main()
