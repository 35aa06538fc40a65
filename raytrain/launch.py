"""Driver side: connect to Ray, check the cluster can run the job, run the TorchTrainer, and
turn its result into run files and a summary.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import zipfile
from dataclasses import dataclass
from typing import Any, NamedTuple

import yaml

from raytrain import checkpoint, report
from raytrain.cluster import check_storage_for_multinode
from raytrain.config import FIELDS, RaytrainError, TrainConfig

# Settings that do not change what is trained: a run may be resumed with other values.
NOT_TRAINING = {"address", "verbose", "keep_cluster", "shared_storage", "compile", "max_failures",
                "wait_timeout", "log_every", "name", "storage_path", "keep_checkpoints",
                "use_gpu", "cpus_per_worker", "num_workers"}
STATE_TRACKING = {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}  # the dashboard's Train view
# The Train controller polls workers every 2 s by default and a worker's report waits for
# that poll: with short epochs this cost ~2 s per epoch (20 digits epochs: 65 s -> see README).
CONTROLLER_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
TOKEN_FILE = os.path.expanduser("~/.ray/auth_token")
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
PREEMPTION_WATCHER_BY_USER = PREEMPTION_WATCHER in os.environ  # before raytrain sets it
if os.path.exists(TOKEN_FILE) and "ray" not in sys.modules:
    # Ray 2.60's client sends the token to an existing cluster only in token mode, read when
    # ray is first imported (seen: "InvalidAuthToken" retries until the connect timeout). A
    # token-mode client still joins a cluster without auth, and a new local one has auth on.
    # Once ray is imported the mode is fixed: changing it then would only reach the processes
    # a new local cluster starts, and they would refuse this client.
    os.environ.setdefault("RAY_AUTH_MODE", "token")


class TrainingError(RaytrainError):
    """Training started but did not finish (exit code 1)."""


class Interrupted(TrainingError):
    """Ctrl-C stopped the run (exit code 130); the checkpoints so far are kept."""


@dataclass
class Summary:
    run_dir: str
    rows: list[dict[str, Any]]
    wall_s: float
    first_step_s: float | None
    model_path: str | None
    startup: list[tuple[str, float]] | None = None  # the time to first step, by phase

    @property
    def final(self) -> dict[str, Any]:
        return self.rows[-1] if self.rows else {}


# ---------------------------------------------------------------------------- cluster


def connect(address: str | None, verbose: bool = False, keep_cluster: bool = False) -> bool:
    """Connect to ``address`` / $RAY_ADDRESS, or start a new local cluster.

    Returns True when raytrain started the cluster (and so must stop it). Never a bare
    ``ray.init()``: it would join a dead cluster recorded in /tmp/ray and wait forever.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
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
            ctx = ray.init(address="local", **kwargs)
            start_state_actor()
            print_dashboard(ctx.dashboard_url, kept=False)
            return True
    _check_reachable(address)
    try:
        ctx = ray.init(address=address, **kwargs)
    except Exception as err:
        raise RaytrainError(f"--address {address}: cannot connect to a Ray cluster there "
                            f"({type(err).__name__}: {str(err).splitlines()[0][:120]})") from None
    start_state_actor()
    if kept:
        print_dashboard(ctx.dashboard_url, kept=True)
    return False


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


def start_state_actor() -> None:
    """Start Ray Train's state actor (the dashboard's Train view reads it) as soon as Ray is up.

    Train's controller starts it otherwise, and waits for it, on the way to the first step;
    from here it starts beside the driver's preflight and the controller (a new local cluster:
    in a worker process Ray has already started). It lives as long as the cluster: on a
    running cluster this finds the one there."""
    try:
        from ray.train.v2._internal.state.state_actor import get_or_create_state_actor

        get_or_create_state_actor()
    except Exception:  # another Ray version, a cluster without a head resource: the
        pass           # controller starts it as before; only sooner is lost


def start_head() -> str:
    """``ray start --head`` for --keep-cluster: the cluster and its dashboard outlive the run."""
    import subprocess
    import sys

    # `ray start` binds the dashboard to exactly --dashboard-port (8265 unless given) and, with
    # that port taken (another local cluster), starts none, silently: pass a free one.
    port = _free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
           f"--port={port}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={_free_port(8265)}", "--disable-usage-stats"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RaytrainError(f"--keep-cluster: ray start --head failed: "
                            f"{(proc.stderr or proc.stdout).strip().splitlines()[-1][:200]}")
    return f"127.0.0.1:{port}"


def _free_port(preferred: int = 0) -> int:
    """``preferred`` if nothing listens there on 127.0.0.1, else a free port."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def print_dashboard(url: str | None, kept: bool) -> None:
    if not url:
        if kept:
            print("Ray dashboard: did not start (see the cluster's logs/dashboard.log); the "
                  "cluster stays up after the run: stop it with `ray stop`", flush=True)
        return
    auth = f"; sign in with the token in {TOKEN_FILE}" if os.path.exists(TOKEN_FILE) else ""
    life = ("it stays up after the run: stop it with `ray stop`" if kept else
            "it closes with this run (--keep-cluster keeps it)")
    print(f"Ray dashboard: http://{url.removeprefix('http://')}{auth}; {life}", flush=True)


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


def check_data(cfg: TrainConfig) -> None:
    """Load a file-backed dataset once on the driver, before any Ray process starts: a missing
    or corrupt --data-dir fails here in one line (and a download lands in the node's cache
    before the workers look for it) instead of in every worker, retried --max-failures times."""
    if cfg.data.dataset in ("cifar10", "cifar100"):
        from raytrain.data import load_dataset

        load_dataset(cfg.data.dataset, cfg.data.data_dir)


def resolve_gpu(cfg: TrainConfig, groups: list[dict]) -> bool:
    """--use-gpu/--no-gpu, else GPUs if the cluster has them or can autoscale to them
    (``groups``: ``autoscaling_groups()``)."""
    import ray

    if cfg.cluster.use_gpu is not None:
        return cfg.cluster.use_gpu
    return ray.cluster_resources().get("GPU", 0) > 0 or \
        any(g["resources"].get("GPU", 0) > 0 for g in groups)


def autoscaling_groups() -> list[dict]:
    """Node groups an autoscaler can still add (empty for a fixed cluster such as a local one):
    [{"resources": {...}, "max_count": n}] with n = -1 for unlimited."""
    import ray._private.state

    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception:  # an older GCS without the autoscaler state namespace
        config = None
    if config is not None:
        return [{"resources": dict(g.resources), "max_count": g.max_count}
                for g in config.node_group_configs if g.max_count != 0]
    # Ray 2.60 never writes that GCS key (no code of it calls its ReportClusterConfig client;
    # get_cluster_config() is None under both autoscalers on a `ray up` cluster). Its
    # autoscaler reads the config `ray up` leaves on the head, and so does raytrain when it
    # runs there (a `ray job submit` job, `ray attach`); elsewhere it cannot know.
    return bootstrap_groups(os.path.expanduser(BOOTSTRAP_CONFIG))


# Written by `ray up` (autoscaler/_private/commands.py, as JSON) with every node type's
# max_workers filled in and, on AWS, its resources looked up; the head's autoscaler reads it.
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"


def bootstrap_groups(path: str) -> list[dict]:
    """The node types of a `ray up` config that can add nodes; [] for a missing or broken file.

    A type with no resources is left out: Ray detects them when its node starts, so nobody
    knows what it would add (the `local` provider's one type, whose max_workers is the listed
    machines: they are all kept up anyway, there is nothing to ask for)."""
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
        cap = config.get("max_workers", float("inf"))  # worker nodes of all types together
        groups = []
        for name, node_type in config["available_node_types"].items():
            # Ray's defaults (fill_node_type_min_max_workers): 0 for the head's type, else cap
            n = min(node_type.get("max_workers", 0 if name == config.get("head_node_type")
                                  else cap), cap)
            if n > 0 and node_type.get("resources"):
                groups.append({"resources": {k: float(v) for k, v in
                                             node_type["resources"].items()},
                               "max_count": -1 if n == float("inf") else int(n)})
        return groups
    except (OSError, yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError):
        return []


class Shape(NamedTuple):
    use_gpu: bool  # the workers take a GPU each (resolve_gpu)
    one_host: bool  # one node, and no node type to add
    can_grow: bool  # an autoscaler can add nodes the workers fit on


def preflight(cfg: TrainConfig) -> Shape:
    """Fail within seconds when the cluster cannot place the workers: Ray itself would retry
    forever. An autoscaling cluster, or an elastic MIN:MAX run, gets --wait-timeout to grow,
    with a visible message; an impossible request fails at once either way."""
    import ray

    c = cfg.cluster
    groups = autoscaling_groups()
    use_gpu = resolve_gpu(cfg, groups)
    need = {"CPU": c.cpus_per_worker} | ({"GPU": 1.0} if use_gpu else {})
    can_grow = any(_fits(g["resources"], need) for g in groups)
    if groups:  # nodes that join later are other hosts: a local path would be split
        check_storage_for_multinode(cfg.run.storage_path, [
            {"Alive": True, "NodeManagerAddress": "head"},
            {"Alive": True, "NodeManagerAddress": "autoscaled"}], c.shared_storage)
    patient = can_grow or isinstance(c.num_workers, tuple)
    deadline = time.monotonic() + (c.wait_timeout if patient else 0)
    requested = False
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        placeable = sum(_fits(n["Resources"], need) for n in alive)
        if placeable >= c.min_workers:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            _clear_request(requested)
            raise RaytrainError(_no_room(c, need, use_gpu, placeable, len(alive), patient))
        if can_grow and not requested:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[need] * c.min_workers)
            requested = True
        print(f"waiting for resources: room for {placeable}/{c.min_workers} workers"
              + (" (autoscaler asked for more nodes)" if requested else "")
              + f"; --wait-timeout {c.wait_timeout:g}s", flush=True)
        time.sleep(min(5.0, left))
    _clear_request(requested)  # the workers' placement group now holds what they need
    check_storage_for_multinode(cfg.run.storage_path, alive, c.shared_storage)
    return Shape(use_gpu=use_gpu, one_host=len(alive) == 1 and not groups, can_grow=can_grow)


def _clear_request(requested: bool) -> None:
    if requested:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])


def _no_room(c, need: dict[str, float], use_gpu: bool, placeable: int, n_nodes: int,
             waited: bool) -> str:
    import ray

    total = ray.cluster_resources()
    has = f"{total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs in {n_nodes} node(s)"
    asked = " + ".join(f"{v:g} {k}" for k, v in need.items())
    after = f" after waiting {c.wait_timeout:g}s" if waited else ""
    return (f"--num-workers {c.min_workers} needs {c.min_workers} x ({asked}) per worker; the "
            f"cluster has {has}, room for {placeable}{after}. Lower --num-workers/"
            "--cpus-per-worker" + (", drop --use-gpu" if use_gpu else "") + ", or add nodes")


def _fits(node: dict[str, float], need: dict[str, float]) -> int:
    """How many workers needing ``need`` fit on a node with ``node`` resources."""
    return int(min(node.get(k, 0.0) // v for k, v in need.items()))


# ---------------------------------------------------------------------------- run dir


def prepare_run_dir(cfg: TrainConfig, resume: bool = False, fresh: bool = False) -> int:
    """Create or re-open the run directory; returns the epoch a resumed run restarts after.

    A run directory holding a different config is refused unless --resume or --fresh:
    nothing already saved is touched before that choice is explicit.
    """
    run_dir = cfg.run_dir
    saved_path = os.path.join(run_dir, "config.yaml")
    try:
        os.makedirs(cfg.run.storage_path, exist_ok=True)
        probe = os.path.join(cfg.run.storage_path, f".raytrain-write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as err:
        raise RaytrainError(f"--storage-path {cfg.run.storage_path}: not writable "
                            f"({err.strerror})") from None
    if fresh and os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    done = 0
    if os.path.exists(saved_path):
        with open(saved_path) as f:
            saved = yaml.safe_load(f) or {}
        changed = sorted(k for k, v in cfg.to_flat().items()  # search settings don't train
                         if k not in NOT_TRAINING and FIELDS[k][0] != "tune"
                         and saved.get(k) != v)
        if changed and not resume:
            diff = ", ".join(f"{k}: {saved.get(k)!r} -> {cfg.to_flat()[k]!r}" for k in changed)
            raise RaytrainError(f"--name {cfg.run.name}: {run_dir} holds a run with another "
                                f"config ({diff}); pass --resume to continue it with these "
                                "settings, --fresh to delete it and start over, or another --name")
        done = latest_checkpoint_epoch(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    report._atomic_write(saved_path, yaml.safe_dump(cfg.to_flat(), sort_keys=False))
    return done


def latest_checkpoint_epoch(run_dir: str) -> int:
    """The newest epoch with a complete checkpoint: a copy cut short (a killed run) has no
    state file or a truncated one (torch.save writes a zip; its directory comes last)."""
    epochs = [int(d.rsplit("_", 1)[1]) for d in os.listdir(run_dir)
              if d.startswith("checkpoint_epoch_") and d.rsplit("_", 1)[1].isdigit()
              and zipfile.is_zipfile(os.path.join(run_dir, d, checkpoint.STATE_FILE))]
    return max(epochs, default=0)


# ---------------------------------------------------------------------------- training


def build_trainer(cfg: TrainConfig, shape: Shape, callbacks: list | None = None,
                  driver_outlives_run: bool = False):
    """Ray Train's TorchTrainer for ``cfg``, less the actors this run has no use for
    (``trainer.py``)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.config import LoggingConfig

    from raytrain.loop import train_loop_per_worker
    from raytrain.trainer import Trainer

    c = cfg.cluster
    return Trainer(
        train_loop_per_worker,
        fixed_cluster=not shape.can_grow, driver_outlives_run=driver_outlives_run,
        train_loop_config=cfg.to_flat(),
        scaling_config=ScalingConfig(num_workers=c.num_workers, use_gpu=shape.use_gpu,
                                     resources_per_worker={"CPU": c.cpus_per_worker}
                                     | ({"GPU": 1} if shape.use_gpu else {})),
        run_config=RunConfig(
            name=cfg.run.name, storage_path=cfg.run.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints,
                                               checkpoint_score_attribute="test_acc",
                                               checkpoint_score_order="max"),
            # A finite controller limit: no failure is retried forever.
            failure_config=FailureConfig(max_failures=c.max_failures,
                                         controller_failure_limit=3),
            callbacks=callbacks if callbacks is not None else [RunFiles(cfg.run_dir)],
            logging_config=LoggingConfig(log_level="INFO" if cfg.run.verbose else "WARNING")))


def _run_files_base():
    from ray.train.v2.api.callback import UserCallback

    return UserCallback


class RunFiles(_run_files_base()):
    """Train-controller callback (runs on the driver's node): writes metrics.jsonl/.csv and
    events.jsonl in the run directory after every report."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._tensorboard = None

    def after_report(self, run_context, metrics, checkpoint) -> None:
        m = metrics[0]
        report.record_epoch(self.run_dir, m)
        if self._tensorboard is None:
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
        for key in report.METRICS[1:]:
            self._tensorboard.add_scalar(key, m[key], m["epoch"])
        self._tensorboard.flush()

    def after_exception(self, run_context, worker_exceptions) -> None:
        rank, err = sorted(worker_exceptions.items())[0]
        try:
            report.append_event(self.run_dir, {"event": "worker_failure", "rank": rank,
                                               "error": f"rank {rank}: {_short(err)}",
                                               "time": time.time()})
        except OSError:  # a full disk: raising here would fail the run on this, not on err
            pass


def fit(cfg: TrainConfig, started_at: float, resume: bool = False, fresh: bool = False
        ) -> Summary:
    """Run one training job on the connected cluster and write the run files."""
    connected_at = time.time()
    shape = preflight(cfg)
    train_env(shape)
    done = prepare_run_dir(cfg, resume=resume, fresh=fresh)
    model_path = os.path.join(cfg.run_dir, "model.pt")
    if done >= cfg.optim.epochs and os.path.exists(model_path):
        print(f"run {cfg.run.name} already finished all {done} epochs; nothing to train "
              "(--fresh starts over)", flush=True)
        return Summary(cfg.run_dir, report.read_metrics(cfg.run_dir), 0.0, None, model_path)
    if done:
        print(f"resuming run {cfg.run.name} from its epoch {done} checkpoint "
              f"({cfg.optim.epochs - done} epochs to go)", flush=True)
    trainer = build_trainer(cfg, shape)
    driver = [("Ray up", connected_at), ("preflight", time.time())]
    with report.EpochPrinter(cfg.run_dir, cfg.optim.epochs):
        try:
            result = trainer.fit()
        except (KeyboardInterrupt, SystemExit):  # Ray's Ctrl-C handler aborted the run
            result = None
        except Exception as err:  # Ray raises TrainingFailedError past the failure budget
            raise TrainingError(_failed(cfg, err)) from None
    if result is not None and result.error is not None:
        raise TrainingError(_failed(cfg, result.error))
    rows = report.read_metrics(cfg.run_dir)
    if rows and "error" in rows[-1]:
        raise TrainingError(rows[-1]["error"])
    if not rows or rows[-1]["epoch"] < cfg.optim.epochs:  # Ctrl-C: Ray aborted the run
        raise Interrupted(f"interrupted after epoch {rows[-1]['epoch'] if rows else 0} of "
                            f"{cfg.optim.epochs}; rerun the same command to resume")
    model_path = export_model(cfg.run_dir, result.checkpoint)
    report.plot_curves(cfg.run_dir, rows)
    # The first epoch this command trained (a worker group restarted after a failure adds a
    # later first_step_at; a resumed run's earlier rows are older than started_at).
    first = [r for r in rows if r.get("first_step_at", 0) > started_at]
    return Summary(cfg.run_dir, rows, time.time() - started_at,
                   first[0]["first_step_at"] - started_at if first else None, model_path,
                   report.startup_phases(started_at, driver, first[0]) if first else None)


def export_model(run_dir: str, ckpt) -> str | None:
    """model.pt: a plain state_dict of the unwrapped model, loadable without raytrain."""
    if ckpt is None:
        return None
    import torch

    with ckpt.as_directory() as directory:
        weights = checkpoint.model_weights(directory)
    path = os.path.join(run_dir, "model.pt")
    torch.save(weights, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def _failed(cfg: TrainConfig, err: BaseException) -> str:
    cause = getattr(err, "controller_failure", None)  # Ray's ControllerError
    if isinstance(cause, OSError) and cause.errno:  # metrics.jsonl etc. on a full disk
        done = latest_checkpoint_epoch(cfg.run_dir)
        kept = f"the epoch {done} checkpoint is intact" if done else "no checkpoint was saved"
        return checkpoint.storage_failure("writing the run files failed", cause,
                                          cfg.run.storage_path, kept)
    restarts = sum(1 for e in report.read_jsonl(os.path.join(cfg.run_dir, "events.jsonl"))
                   if e["event"] == "worker_failure")
    return (f"training failed ({_short(err)}; {restarts} worker failure(s), --max-failures "
            f"{cfg.cluster.max_failures}); rerun the same command to resume from the latest "
            "checkpoint")


def _short(err: BaseException) -> str:
    """The gist of a (Ray) error in one short line: its last line, first sentence."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    last = lines[-1]
    if "worker process has died" in last or "actor died" in last.lower():
        return "a worker process died"
    return last.split(". ")[0][:200]
