"""The Ray cluster a run uses: connect to one (--address, $RAY_ADDRESS) or start a local one,
and the environment Ray Train reads from the process that runs a trainer.

    from raytrain.driver.cluster import connect
    started = connect(None)      # a new local cluster; True: raytrain must ray.shutdown() it
"""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from raytrain import ray_compat
from raytrain.driver import console
from raytrain.driver.console import TOKEN_FILE
from raytrain.errors import RaytrainError

if TYPE_CHECKING:
    from raytrain.driver.preflight import Shape

STATE_TRACKING = {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}  # the dashboard's Train view
# The Train controller polls workers every 2 s by default and a worker's report waits for
# that poll: with short epochs this cost ~2 s per epoch (20 digits epochs: 65 s -> see README).
CONTROLLER_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
PREEMPTION_WATCHER_BY_USER = PREEMPTION_WATCHER in os.environ  # before raytrain sets it


def token_auth_env() -> None:
    """Token mode for the Ray client when a token file exists: call before ray is imported."""
    if os.path.exists(TOKEN_FILE) and "ray" not in sys.modules:
        # Ray 2.60's client sends the token to an existing cluster only in token mode, read when
        # ray is first imported (seen: "InvalidAuthToken" retries until the connect timeout). A
        # token-mode client still joins a cluster without auth, and a new local one has auth on.
        # Once ray is imported the mode is fixed: changing it then would only reach the processes
        # a new local cluster starts, and they would refuse this client.
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def connect(address: str | None, verbose: bool = False, keep_cluster: bool = False) -> bool:
    """Connect to ``address`` / $RAY_ADDRESS, or start a new local cluster.

    Returns True when raytrain started the cluster (and so must stop it). Never a bare
    ``ray.init()``: it would join a dead cluster recorded in /tmp/ray and wait forever.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    token_auth_env()
    import ray

    train_env()
    if ray.is_initialized():
        return False
    kept = None
    # Ray forwards every worker's and controller's output to the driver: tracebacks of
    # expected failures, deprecation notes. raytrain prints what matters itself. No job-wide
    # runtime_env: the workers a new cluster prestarts serve only jobs without one.
    kwargs: dict[str, Any] = dict(logging_level="INFO" if verbose else "ERROR",
                                  log_to_driver=verbose)
    if address is None:
        if not verbose:  # processes of a cluster we start inherit this: no deprecation noise
            os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
        if keep_cluster:
            address = kept = start_head()
        else:
            ctx = ray_compat.init_local(**kwargs)  # its processes know its address
            start_state_actor()
            console.print_dashboard(ctx.dashboard_url, kept=False)
            return True
    _check_reachable(address)
    try:
        ctx = ray.init(address=address, **kwargs)
    except Exception as err:
        raise RaytrainError(f"--address {address}: cannot connect to a Ray cluster there "
                            f"({type(err).__name__}: {str(err).splitlines()[0][:120]})") from None
    start_state_actor(ctx.address_info.get("gcs_address"))
    if kept:
        console.print_dashboard(ctx.dashboard_url, kept=True)
    return False


def disconnect(started: bool) -> None:
    """Stop the cluster ``connect`` started (and restore the environment it set)."""
    if started:
        ray_compat.shutdown()


def train_env(shape: Shape | None = None) -> None:
    """Settings Ray Train reads from the environment of the process that runs a trainer (the
    driver, or a Tune trial) and passes on to its controller and workers."""
    os.environ.update(STATE_TRACKING)
    for key, value in CONTROLLER_ENV.items():
        os.environ.setdefault(key, value)
    if shape is not None and not PREEMPTION_WATCHER_BY_USER:
        # Train's PreemptionWatcher drains workers on nodes about to be preempted; on one host
        # the driver goes down with them. Its actor is one more process starting beside the
        # workers (seen at 19.5 s of a 24 s time to first step on 2 cores) and polls every 5 s.
        if shape.one_host:
            os.environ[PREEMPTION_WATCHER] = "0"
        else:
            os.environ.pop(PREEMPTION_WATCHER, None)


def start_state_actor(address: str | None = None) -> None:
    """Start Ray Train's state actor (the dashboard's Train view reads it) as soon as Ray is up.

    Train's controller starts it otherwise, and waits for it, on the way to the first step;
    from here it starts beside the driver's preflight and the controller (a new local cluster:
    in a worker process Ray has already started). It lives as long as the cluster: on a
    running cluster this finds the one there, or makes it knowing ``address`` (never a stale
    /tmp/ray address file: ray_compat.start_train_state_actor)."""
    ray_compat.start_train_state_actor(address)


# A prestarted worker nobody takes goes when the driver's job ends, or when idle after this.
PRESTART_KEEP_ALIVE_S = 120


def worker_env() -> dict[str, str]:
    """The env vars of every Train worker's runtime env: each imports torch & co. from its
    start (worker/warm.py)."""
    from raytrain.worker import warm

    return ray_compat.setup_hook_env(warm.HOOK)


def prestart_workers(count: int) -> None:
    """Have this node's raylet start ``count`` Train worker processes of this job now, so that
    they import (worker/warm.py) while the controller starts and places the worker group,
    which then takes them (``ray_compat.prestart_train_workers``). Asked once, before the
    controller exists: a raylet drops what it cannot start at once (it starts at most as many
    processes at a time as it has CPUs), and the controller starts the rest; asked again, a
    late answer would start processes nobody takes."""
    env = worker_env()
    if count < 1 or not env:
        return
    try:
        ray_compat.prestart_train_workers(env, count, PRESTART_KEEP_ALIVE_S)
    except Exception:  # noqa: BLE001 - the raylet did not answer: the controller starts them
        pass


def start_head() -> str:
    """``ray start --head`` for --keep-cluster: the cluster and its dashboard outlive the run."""
    import subprocess

    # `ray start` binds the dashboard to exactly --dashboard-port (8265 unless given) and, with
    # that port taken (another local cluster), starts none, silently: pass a free one.
    port = free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
           f"--port={port}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={free_port(8265)}", "--disable-usage-stats"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RaytrainError(f"--keep-cluster: ray start --head failed: "
                            f"{(proc.stderr or proc.stdout).strip().splitlines()[-1][:200]}")
    return f"127.0.0.1:{port}"


def _check_reachable(address: str) -> None:
    """Fail in seconds, not minutes, when nothing listens at HOST:PORT."""
    target = address.removeprefix("ray://")
    if address == "auto" or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return
    except (OSError, ValueError):
        raise RaytrainError(f"--address {address}: nothing answers at {host}:{port}; start a "
                            "cluster (ray start --head) or omit --address for a local one"
                            ) from None


def free_port(preferred: int = 0) -> int:
    """``preferred`` if nothing listens there on 127.0.0.1, else a port the OS picks."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
