"""Nodes lost and joined during a run: what the Train controller's scaling policy asks before it
starts (or restarts) a worker group, and while one trains.

    watch = NodeWatch(run_dir, {"CPU": 1.0}, min_workers=1, max_workers=2, wait_timeout=60)
    n = watch.start()        # workers to start now; None: wait (raises NoRoom past the timeout)
    n = watch.grow(current)  # elastic, at a checkpointed epoch: more workers, or None

It runs inside the controller (``ray_compat.ClusterPolicy``, on a
cluster that cannot grow) on the driver's node, and writes events.jsonl beside RunFiles; the
driver's EpochPrinter prints them.

Why not Ray's own policies: after a node is SIGKILLed the GCS still lists it alive until it
has missed its health checks (3 s x 5 by default: 15 s, seen in gcs_server.out), and Ray
Train's elastic policy reads a view of the nodes refreshed every 20 s (the autoscaling
coordinator's tick). Both then ask for the lost node's workers again, wait the 60 s worker-group
start timeout and only then restart smaller (measured: 110 s from kill to the next epoch, 1 of
3 controller failures spent). A fixed-size run waits 4 x 60 s for a node and then fails with
Ray's startup-timeout text. Here a node counts as live only while its raylet's port answers,
the wait for room is --wait-timeout, and each step is said on the console.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from raytrain import files, report
from raytrain.driver.preflight import fits
from raytrain.errors import NoRoom

PROBE_TIMEOUT_S = 1.0  # a raylet that does not accept a TCP connection within this is gone
NOTE_EVERY_S = 15.0  # while waiting, a "still waiting" line this often
WAIT_SLEEP_S = 1.0  # between looks while waiting (the controller's loop would spin)
HELD_QUIET_S = 5.0  # CPUs other jobs hold: waited this long before it is said (NodeWatch.unheld)


def reachable(node: dict[str, Any], timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the node's raylet accepts a connection (what the GCS's health check asks, sooner
    than it gives up: a killed raylet refuses at once, a vanished machine times out)."""
    try:
        with socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])),
                                      timeout=timeout):
            return True
    except (OSError, KeyError, ValueError):
        return False


def live_nodes() -> dict[str, dict[str, Any]]:
    """Node id -> ray.nodes() entry, for nodes alive in the GCS whose raylet answers."""
    import ray

    return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive") and reachable(n)}


class NodeWatch:
    """Room for a run's workers on the live nodes, and the bounded wait for it."""

    def __init__(self, run_dir: str, need: dict[str, float], min_workers: int,
                 max_workers: int, wait_timeout: float, checkpoint_every: int = 1,
                 held_is_waited: bool = True):
        self.run_dir, self.need = run_dir, dict(need)
        # CPUs others hold: waited --wait-timeout (unheld). Not in a Tune trial: its siblings
        # hold them (--max-concurrent-trials above what fits), and it waits as Ray Train does
        # (its group's 60 s start timeout, retried 3 times)
        self.held_is_waited = held_is_waited
        self.min_workers, self.max_workers = min_workers, max_workers
        self.wait_timeout, self.checkpoint_every = wait_timeout, checkpoint_every
        self.known: dict[str, str] | None = None  # node id -> IP at the last look
        self.workers: int | None = None  # the size of the latest worker group started
        self.waiting_since: float | None = None
        self.held_since: float | None = None  # room by the totals, held by others since
        self.noted_at = 0.0
        self.metrics_seen: tuple[float, int] | None = None  # metrics.jsonl (mtime, size)
        self.checked_epoch: int | None = None

    # ------------------------------------------------------------------ decisions

    def start(self) -> int | None:
        """Workers to start a worker group with now (the first or after a failure), or None
        while there is no room for ``min_workers`` (after ``WAIT_SLEEP_S``: call again). Past
        --wait-timeout of waiting: NoRoom (the controller stops the run on it)."""
        room = self.look()
        if room < self.min_workers:
            self.held_since = None  # the nodes' totals are short: nodes, not other jobs
        elif self.workers is None and self.held_is_waited:
            free = self.unheld(room)
            if free is None:  # held for a moment: look again, quietly
                time.sleep(WAIT_SLEEP_S)
                return None
            room = free
        if room < self.min_workers:
            self._wait(room)
            return None
        if self.waiting_since is not None:
            self._event("room_back", room=room, waited_s=round(time.time() - self.waiting_since,
                                                                1))
            self.waiting_since = None
        if self.workers is not None:  # a restart: say with how many
            self._event("restart", workers=room, max_workers=self.max_workers)
        self.workers = room
        self.checked_epoch = self._latest_epoch()  # grow() looks at this group's epochs only
        return room

    def grow(self, current: int) -> int | None:
        """While training (elastic runs): more workers when nodes joined, decided once per
        checkpointed epoch so that the restart loses no finished epoch. None: go on."""
        if self.min_workers == self.max_workers or current >= self.max_workers:
            return None
        epoch = self._latest_epoch()
        if epoch is None or epoch == self.checked_epoch or epoch % self.checkpoint_every:
            return None
        self.checked_epoch = epoch
        room = self.look()
        if room <= current:
            return None
        # Room by the nodes' totals may be held by other jobs; grow by what is free (the
        # cluster's sum: a worker's CPUs could be split over nodes, an overestimate at worst
        # by a worker, whose start then times out and the run restarts at the size that fits)
        import ray

        grown = min(room, current + fits(ray.available_resources(), self.need))
        if grown <= current:
            return None
        self._event("grow", workers=grown, max_workers=self.max_workers, after_epoch=epoch)
        self.workers = grown
        return grown

    # ------------------------------------------------------------------ the cluster

    def look(self) -> int:
        """Workers that fit on the live nodes (at most ``max_workers``); a node gone since the
        last look is a ``node_lost`` event, a new one ``node_joined``."""
        live = live_nodes()
        room = min(self.max_workers, sum(fits(n["Resources"], self.need) for n in live.values()))
        now = {node_id: n["NodeManagerAddress"] for node_id, n in live.items()}
        if self.known is not None:
            for node_id in self.known.keys() - now.keys():
                self._event("node_lost", node_id=node_id, node_ip=self.known[node_id],
                            room=room, max_workers=self.max_workers)
            for node_id in now.keys() - self.known.keys():
                self._event("node_joined", node_id=node_id, node_ip=now[node_id], room=room,
                            max_workers=self.max_workers)
        self.known = now
        return room

    def unheld(self, room: int) -> int | None:
        """Before the first worker group: ``room`` less what other jobs hold now (the cluster's
        free resources summed: a worker's share could be split over nodes, an overestimate by
        a worker at worst). Else Ray Train would wait 60 s for its placement group, fail, and
        retry that 3 more times. None while the shortfall is younger than HELD_QUIET_S: an
        ended Tune trial's group being freed is not worth a line on the console. (Restarts
        are not looked at: the controller decides before it frees the last group's CPUs.)"""
        import ray

        free = min(room, fits(ray.available_resources(), self.need))
        if free >= self.min_workers:
            self.held_since = None
            return free
        self.held_since = self.held_since or time.time()
        return None if time.time() - self.held_since < HELD_QUIET_S else free

    def _wait(self, room: int) -> None:
        t, held = time.time(), self.held_since is not None
        if self.waiting_since is None:  # held: counted from the first look that saw it
            self.waiting_since = self.held_since or t
            self.noted_at = t
            self._event("waiting", room=room, need=self.min_workers, timeout_s=self.wait_timeout,
                        held=held)
        elif t - self.waiting_since > self.wait_timeout:
            self._event("wait_timeout", room=room, need=self.min_workers,
                        timeout_s=self.wait_timeout)
            where = ("free on the cluster (other jobs hold the rest)" if held
                     else "on the cluster's live nodes")
            raise NoRoom(f"--wait-timeout {self.wait_timeout:g}s: no room for "
                         f"{self.min_workers} worker(s) {where} after waiting (room for "
                         f"{room})")
        elif t - self.noted_at >= NOTE_EVERY_S:
            self.noted_at = t
            self._event("still_waiting", room=room, need=self.min_workers,
                        left_s=round(self.wait_timeout - (t - self.waiting_since)))
        time.sleep(WAIT_SLEEP_S)

    # ------------------------------------------------------------------ run files

    def _latest_epoch(self) -> int | None:
        """The latest epoch in metrics.jsonl (RunFiles records one after Ray Train has
        registered its checkpoint); read only when the file changed (this runs every poll)."""
        path = os.path.join(self.run_dir, files.METRICS_FILE)
        try:
            st = os.stat(path)
        except OSError:
            return None
        if self.metrics_seen == (st.st_mtime, st.st_size):
            return self.checked_epoch
        self.metrics_seen = (st.st_mtime, st.st_size)
        rows = report.read_metrics(self.run_dir)
        return rows[-1]["epoch"] if rows and "error" not in rows[-1] else None

    def _event(self, name: str, **fields: Any) -> None:
        try:
            report.append_event(self.run_dir, {"event": name, **fields, "time": time.time()})
        except OSError:  # a full disk: the run goes on (or stops) as decided, unrecorded
            pass


def lost_actor_node(err: BaseException | None) -> str | None:
    """"its node was lost (IP, node ID)" when ``err`` is a Ray actor's death or unavailability
    and that actor's node is gone (a Tune trial on a lost node), else None."""
    actor_id = getattr(err, "actor_id", None)
    if not actor_id:
        return None
    try:
        import ray
        from ray.util.state import get_actor

        # The connected cluster's address, never the state API's guess: it takes the one in
        # /tmp/ray/ray_current_cluster, another cluster's where several share a machine.
        actor = get_actor(actor_id, address=ray.get_runtime_context().gcs_address, timeout=10)
        if actor is None or actor.node_id in live_nodes():
            return None

        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == actor.node_id),
                  None)
    except Exception:  # noqa: BLE001 - the state API unreachable: Ray's own reason stands
        return None
    return f"its node was lost ({ip + ', ' if ip else ''}node {actor.node_id[:12]})"


def event_line(event: dict[str, Any]) -> str | None:
    """The console line of a NodeWatch event (driver/console.py prints them), or None."""
    e, kind = event, event["event"]
    if kind == "node_lost":
        return (f"node lost: {e['node_ip']} (node {e['node_id'][:12]}); the live nodes have "
                f"room for {e['room']} of {e['max_workers']} worker(s)")
    if kind == "node_joined":
        return (f"node joined: {e['node_ip']} (node {e['node_id'][:12]}); room for "
                f"{e['room']} of {e['max_workers']} worker(s)")
    if kind == "restart":
        return (f"restarting with {e['workers']} of {e['max_workers']} worker(s) from the "
                "latest checkpoint")
    if kind == "grow":
        return (f"growing to {e['workers']} of {e['max_workers']} worker(s) after epoch "
                f"{e['after_epoch']}: restarting from its checkpoint")
    if kind == "waiting":
        why = ("other jobs hold the cluster's resources" if e.get("held") else
               "a lost node must come back or another join")
        return (f"waiting up to {e['timeout_s']:g}s (--wait-timeout) for room for "
                f"{e['need']} worker(s): the live nodes have room for {e['room']}; {why}")
    if kind == "still_waiting":
        return (f"still waiting for room for {e['need']} worker(s) (room for {e['room']}); "
                f"{e['left_s']}s left")
    if kind == "room_back":
        return f"room for {e['room']} worker(s) again after {e['waited_s']:g}s"
    if kind == "wait_timeout":
        return (f"gave up waiting after {e['timeout_s']:g}s: room for {e['room']} of "
                f"{e['need']} worker(s)")
    return None
