"""Placement groups of Tune trials' Train controllers: record who makes them, remove them once
their controller is dead (Ray keeps them until the search's driver exits).

    with PlacementGroupReaper(os.path.join(exp_dir, "trials")):
        tuner.fit()
"""

from __future__ import annotations

import os
import time

from raytrain.driver.console import Poller
from raytrain.driver.placement import (PG_FILE, RecordPlacementGroup,  # noqa: F401
                                       controllers_in, pending, remove_groups)

class PlacementGroupReaper(Poller):
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

    ``trials_dir`` is on the driver's machine: a search on a bucket records its trials'
    controllers in each trial node's mirror (``tune/trial.py``), so this sees the trials on
    the driver's node only; a stopped trial's group on another node is left to Ray's cleaner.
    """

    QUIET_S = 2.0  # the end of a search: sweeping until this long passes with nothing left

    def __init__(self, trials_dir: str, interval_s: float = 1.0, enabled: bool = True):
        self.trials_dir, self.interval_s, self.enabled = trials_dir, interval_s, enabled

    def __enter__(self):
        if self.enabled:  # without Ray's placement-group table: ray_compat warned once
            self._start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self._stop.set()
        self._thread.join()
        # Trials stopped last (ASHA at the final epoch) may still be dying: a moment for them
        # to go (waiting 30 s here was up to 30 s of a short search's wall).
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                self.sweep()
                if not self.pending():
                    break
            except Exception:  # noqa: BLE001 - e.g. Ray shut down under us (Ctrl-C)
                return
            time.sleep(0.5)
        # The search is over, yet a controller still lives (ending, or, seen once in CI after
        # a PBT search, for good: its trial's CPU held): its group serves nothing of it now.
        # And a controller whose trial Tune has just ended may still be making its workers'
        # group: seen in CI (2026-12-06, an Optuna search) registered 0.2 s after this sweep,
        # its maker destroyed with its trial's group and never marked dead in the group table,
        # one CPU of the session's cluster held for good. So sweep until QUIET_S pass with
        # nothing to remove.
        quiet_until = time.monotonic() + self.QUIET_S
        while time.monotonic() < quiet_until:
            try:
                if self.sweep(alive_too=True):
                    quiet_until = time.monotonic() + self.QUIET_S
            except Exception:  # noqa: BLE001 - as above
                return
            time.sleep(0.25)

    def controllers(self) -> set[str]:
        if not os.path.isdir(self.trials_dir):
            return set()
        return controllers_in(os.path.join(self.trials_dir, trial, PG_FILE)
                              for trial in sorted(os.listdir(self.trials_dir)))

    def pending(self) -> list[str]:
        """The placement groups of this search's controllers that are not removed yet."""
        return pending(self.controllers())

    def poll(self) -> None:
        try:
            self.sweep()
        except Exception:  # noqa: BLE001 - a failed sweep is retried at the next tick
            pass

    def sweep(self, alive_too: bool = False) -> int:
        """Remove every placement group a dead controller of this search made (``alive_too``:
        a live one's as well); returns how many."""
        return remove_groups(self.controllers(), alive_too)

