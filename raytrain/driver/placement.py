"""Placement groups of Train controllers: record who makes them, remove the ones a controller
left (Ray keeps a group until the job that made it ends: the driver).

    record = RecordPlacementGroup(path)      # a Train-controller callback
    remove_groups(controllers_in([path]), alive_too=True)   # after the run, on the driver
"""

from __future__ import annotations

from raytrain import files, ray_compat

PG_FILE = "placement_groups.jsonl"


class RecordPlacementGroup(ray_compat.worker_group_callback_base()):
    """Train-controller callback: notes the controller (a line of ``path``) before it creates
    a worker group's placement group: a group that never finished starting is found too."""

    def __init__(self, path: str):
        self.path = path
        self.recorded = False

    def before_worker_group_start(self, worker_group_context) -> None:
        import ray

        if not self.recorded:  # once per controller: its restarts make new groups too
            files.append_jsonl(self.path, {"controller": ray.get_runtime_context().get_actor_id()})
            self.recorded = True


def controllers_in(paths) -> set[str]:
    """The controllers recorded in ``paths`` (files ``RecordPlacementGroup`` wrote)."""
    return {rec["controller"] for path in paths for rec in files.read_jsonl(path)}


def remove_groups(controllers: set[str], alive_too: bool = False) -> int:
    """Remove the placement groups ``controllers`` made and left (of a dead controller only,
    unless ``alive_too``); returns how many."""
    removed = 0
    for pg, creator, creator_dead in ray_compat.live_placement_groups():
        if creator in controllers and (creator_dead or alive_too):
            ray_compat.remove_placement_group(pg)
            removed += 1
    return removed


def pending(controllers: set[str]) -> list[str]:
    """The placement groups ``controllers`` made that are not removed yet."""
    return [pg for pg, creator, _ in ray_compat.live_placement_groups() if creator in controllers]
