"""ASHA for raytrain's searches: Ray's ASHAScheduler plus a late check of passed rungs.

    from raytrain.tune.asha import LateCheckASHA
"""

from __future__ import annotations

from raytrain import ray_compat

# ASHA ranks trials at its rungs by test loss, not accuracy: early in training (a onecycle
# warm-up, a tiny dataset) many trials sit at exactly chance accuracy, and Ray's ASHA lets a
# trial that ties the cutoff go on, so nothing was stopped (digits seed 2: every trial at 0.10
# for 4 epochs: 48% of the worker-epochs of --scheduler none; by loss: 20%, same best trial;
# benchmarks/asha_replay.py replays the measured curves).
RUNG_METRIC, RUNG_MODE = "test_loss", "min"


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
        metric = ray_compat.asha_setting(self, "metric")
        if action != TrialScheduler.CONTINUE or metric not in result:
            return action
        rungs = ray_compat.asha_rungs(self, trial.trial_id)
        if rungs is not None and fell_behind(*rungs, trial.trial_id,
                                             result[ray_compat.asha_setting(self, "time_attr")]):
            ray_compat.asha_count_stopped(self)
            return TrialScheduler.STOP
        return action


def fell_behind(rungs, cutoff, trial_id: str, now: float) -> bool:
    """Whether ``trial_id`` is below the cutoff of a rung it passed before ``now`` (the cutoff
    of everything recorded at that rung, the trial included: with it alone there, never)."""
    for milestone, recorded in rungs:
        if milestone < now and trial_id in recorded:
            mine = recorded[trial_id]
            if mine < cutoff(recorded):  # NaN compares False: never stopped for it
                return True
    return False

