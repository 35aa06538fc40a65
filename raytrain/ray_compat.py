"""The one module that touches Ray's private or internal code.

Written against Ray 2.60 (2026-12-03); ``pyproject.toml`` pins ``ray==2.60.*``. Each use below
says what it works around and what happens when a Ray version lacks it:

- REQUIRED: ``check()`` (on the driver beside ray.init; never on workers, never retried)
  stops with one line naming the internal.
- FALLBACK: raytrain runs without it, as documented there, and warns once
  (``RayCompatWarning``) naming what is lost.

A new Ray: run the whole suite (``tests/test_architecture.py`` runs every fallback), re-read
the uses below against its sources, then widen the pin.

    python -c "from raytrain import ray_compat; ray_compat.check()"
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import os
import threading
import warnings
from typing import Any, Callable

from raytrain.errors import RaytrainError
from raytrain.worker import rendezvous

WRITTEN_FOR = "Ray 2.60 (2026-12-03)"


class RayCompatWarning(UserWarning):
    """A Ray internal raytrain uses is missing; a documented fallback runs instead."""


_warned: set[str] = set()


def warn_once(key: str, lost: str) -> None:
    """One warning per process and internal: ``key`` is missing, ``lost`` is the consequence."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"raytrain: this Ray lacks {key} (written for {WRITTEN_FOR}): {lost}",
                  RayCompatWarning, stacklevel=3)


def _lost(key: str) -> None:
    """Warn once that the FALLBACKS internal ``key`` is missing, with what that costs."""
    warn_once(key, FALLBACKS[key][1])


def _internal(module: str, name: str | None = None) -> Any:
    """``module`` (or its attribute ``name``); None when this Ray lacks it."""
    try:
        mod = importlib.import_module(module)
        return mod if name is None else getattr(mod, name)
    except (ImportError, AttributeError):
        return None


# ---------------------------------------------------------------------------- start-up check


def check() -> None:
    """On the driver at start-up: a missing REQUIRED internal is one RaytrainError; a missing
    FALLBACK internal is one warning each (its fallback then runs silently where it is used)."""
    missing = [name for name, present in REQUIRED.items() if not present()]
    if missing:
        import ray

        raise RaytrainError(f"Ray {ray.__version__} lacks {', '.join(missing)}, which raytrain "
                            f"needs (written for {WRITTEN_FOR}); install ray==2.60.* (the "
                            "version pyproject.toml pins)")
    for name, (present, lost) in FALLBACKS.items():
        if not present():
            warn_once(name, lost)


# ---------------------------------------------------------------------------- worker side


# REQUIRED. Rank 0 copies its checkpoint into the run's storage itself, before report(), so a
# failing save (full disk) stops the run cleanly on every rank (worker/ray_entry.EpochReports
# says why report()'s own copy cannot). get_storage() is a DeveloperAPI; its StorageContext
# (train/v2/_internal/execution/storage.py) is internal. Missing: check() fails at start-up.
STORAGE_CONTEXT = "ray.train.v2._internal.execution.storage.StorageContext"
_STORAGE_METHODS = ("build_checkpoint_path_from_name", "persist_current_checkpoint")


def _has_storage_context() -> bool:
    cls = _internal("ray.train.v2._internal.execution.storage", "StorageContext")
    ctx = _internal("ray.train.v2._internal.execution.context", "TrainContext")
    return cls is not None and ctx is not None and hasattr(ctx, "get_storage") and all(
        hasattr(cls, m) for m in _STORAGE_METHODS)


class CheckpointStorage:
    """The run's checkpoint storage as Ray Train's own report() writes it (on a worker)."""

    def __init__(self):
        import ray.train

        self._storage = ray.train.get_context().get_storage()

    def path_of(self, name: str) -> str:
        return self._storage.build_checkpoint_path_from_name(name)

    def persist(self, ckpt, name: str):
        return self._storage.persist_current_checkpoint(ckpt, name)

    def delete(self, path: str) -> None:
        self._storage.storage_filesystem.delete_dir(path)


# FALLBACK. Ray Train 2.60 logs every report at INFO on a logger named by the file path of
# train/v2/_internal/execution/context.py, forwarded to the driver (one line per epoch per
# worker). Missing: those lines are not silenced (the run is unchanged).
TRAIN_CONTEXT_LOGGER = "ray.train.v2._internal.execution.context"


def quiet_report_logs() -> None:
    module = _internal(TRAIN_CONTEXT_LOGGER)
    if module is not None and getattr(module, "__file__", None):
        logging.getLogger(module.__file__).setLevel(logging.WARNING)


# FALLBACK (2026-12-04). A function run in every Train worker process as it starts (worker/
# warm.py), read from this env var (_private/workers/default_worker.py); runtime_env's public
# "worker_process_setup_hook" sets it in a job's runtime_env only, silently not in an actor's.
# Missing: workers import as they go.
SETUP_HOOK_ENV = "ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def setup_hook_env(hook: str) -> dict[str, str]:
    """The env var (for an actor's runtime_env) that makes its process run ``hook``."""
    name = _internal("ray._private.ray_constants", "WORKER_PROCESS_SETUP_HOOK_ENV_VAR")
    return {} if name is None else {name: hook}


# ---------------------------------------------------------------------------- driver side


# FALLBACK (2026-12-07). Train worker processes started as soon as the driver knows the run's
# shape (issue #27): the raylet's PrestartWorkers RPC (Ray #48677, no public API) with the
# runtime env Ray Train's controller gives its workers, whose serialised string the raylet
# matches idle workers by: get_env_vars_to_propagate() + RAY_WARN_BLOCKING_GET_INSIDE_ASYNC
# (train/v2 worker_group.py _get_worker_runtime_env, data_parallel_trainer.py) as the core
# worker writes a child's env merged into its parent's (compact JSON, sorted keys). Missing (or
# raylets with Train env vars of their own): the workers start when the controller asks.
PRESTART = "ray.core.generated.node_manager_pb2.PrestartWorkersRequest"


def _prestart_internals() -> tuple | None:
    found = tuple(_internal(*name) for name in (
        ("ray.core.generated.node_manager_pb2",), ("ray.core.generated.node_manager_pb2_grpc",),
        ("ray.core.generated.common_pb2",), ("ray._private.grpc_utils", "init_grpc_channel"),
        ("ray._private.utils", "get_runtime_env_info"), ("ray.train.v2._internal.constants",)))
    ok = None not in found and hasattr(found[0], "PrestartWorkersRequest") and hasattr(
        found[5], "DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE")
    return found if ok else None


def prestart_train_workers(env_vars: dict[str, str], count: int, keep_alive_s: int) -> bool:
    """Ask this node's raylet for ``count`` processes of this job for Train workers whose
    ``worker_runtime_env`` has ``env_vars``. False where this Ray lacks it (nothing asked)."""
    found = _prestart_internals()
    if found is None:
        _lost(PRESTART)
        return False
    pb, stubs, common, channel, env_info, train = found
    import ray
    from ray.runtime_env import RuntimeEnv

    env = train.get_env_vars_to_propagate()
    env.setdefault(train.RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                   train.DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    env.update(env_vars)
    info = env_info(RuntimeEnv(env_vars=env))
    info.serialized_runtime_env = json.dumps({"env_vars": env}, sort_keys=True,
                                             separators=(",", ":"))
    here = ray.get_runtime_context()
    node = next(n for n in ray.nodes() if n["NodeID"] == here.get_node_id())
    stubs.NodeManagerServiceStub(channel(f"{node['NodeManagerAddress']}:"
                                         f"{node['NodeManagerPort']}")).PrestartWorkers(
        pb.PrestartWorkersRequest(language=common.PYTHON, job_id=bytes.fromhex(here.get_job_id()),
                                  runtime_env_info=info, keep_alive_duration_secs=keep_alive_s,
                                  num_workers=count), timeout=10)
    return True


# FALLBACK. The checkpoint directories Ray Train registered: the run's checkpoint_manager_
# snapshot.json (2.60 train/v2/_internal/constants.py; checkpoint_manager.py _save_state writes
# it at every registration; a re-run resumes from its latest_checkpoint_result). A Ctrl-C between
# rank 0's write and report() leaves one Ray never resumes from. Missing: every complete
# checkpoint directory counts as registered (a resume may be announced later), none is pruned.
CHECKPOINT_SNAPSHOT = "ray.train.v2._internal.constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME"


def registered_checkpoints(run_dir: str) -> tuple[set[str], str | None] | None:
    """(checkpoint directory names Ray Train references in ``run_dir``, a path or URI; the
    latest's name); (set(), None) before any; None where this Ray's record is unknown."""
    filename = _internal("ray.train.v2._internal.constants",
                         "CHECKPOINT_MANAGER_SNAPSHOT_FILENAME")
    if filename is None:
        _lost(CHECKPOINT_SNAPSHOT)
        return None
    from raytrain import storage

    data = storage.read_bytes(storage.join(run_dir, filename))  # a local path or a bucket URI
    if data is None:
        return set(), None
    try:
        snapshot = json.loads(data)
        results = [*snapshot["checkpoint_results"], *snapshot.get("pending_training_results", [])]
        latest = snapshot["latest_checkpoint_result"]
        last = latest["checkpoint_dir_name"] if latest else None
        return {r["checkpoint_dir_name"] for r in results} | ({last} if last else set()), last
    except (OSError, ValueError, KeyError, TypeError):
        _lost(CHECKPOINT_SNAPSHOT)
        return None


# FALLBACK. The CPUs a new local cluster gets (2.60 _private/utils.py get_num_cpus: cgroup quota,
# else cpu_count()): workers that cannot fit are refused before it starts. Missing: cpu_count().
LOCAL_CPUS = "ray._private.utils.get_num_cpus"


def local_cpus() -> float:
    count = _internal("ray._private.utils", "get_num_cpus")
    if count is None:
        _lost(LOCAL_CPUS)
        return float(os.cpu_count() or 1)
    return float(count())


# FALLBACK (2026-12-04). A new local cluster whose processes know its address. A Ray process
# seeking "the" cluster (State API: services.py) takes $RAY_ADDRESS, else the ray_current_cluster
# file: the last `ray start` here, dead or alive (Ray #45771, #27021). Train 2.60's state actor
# calls get_actor every 30 s holding the lock the controller's last update needs: following a
# dead cluster, runs ended 40 s late (issue #27). So the GCS port ($RAY_GCS_SERVER_PORT, _private/
# node.py) and $RAY_ADDRESS are set before it starts. Missing: a stale file may stall a run's end.
GCS_PORT_ENV = "ray._private.ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE"
_saved_env: list[dict[str, str | None]] = []


def init_local(**kwargs):
    """``ray.init(address="local", **kwargs)`` whose processes find it; pair with
    ``shutdown()``."""
    import socket

    import ray
    from ray.util import get_node_ip_address

    env: dict[str, str] = {}
    name = _internal("ray._private.ray_constants", "GCS_PORT_ENVIRONMENT_VARIABLE")
    if name is None:
        _lost(GCS_PORT_ENV)
    else:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = os.environ.get(name) or str(sock.getsockname()[1])
        env.update({name: port, "RAY_ADDRESS": f"{get_node_ip_address()}:{port}"})
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with _dashboard_beside_raylet():
            ctx = ray.init(address="local", **kwargs)
    except BaseException:
        _set_env(before)
        raise
    _set_env({k: v for k, v in before.items() if k != "RAY_ADDRESS"})  # read at start
    if name is not None:  # the driver's own until shutdown(), then restored
        _saved_env.append({"RAY_ADDRESS": before["RAY_ADDRESS"]})
        if ctx.address_info.get("gcs_address") != env["RAY_ADDRESS"]:
            _lost(GCS_PORT_ENV)
            os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
    return ctx


# FALLBACK (2026-12-07). A new local cluster's dashboard starts beside its raylet: 2.60's
# Node.start_head_processes waits for the dashboard's URL (1.6-1.7 s of a 3.5 s ray.init on 2
# cores, _private/services.py start_api_server) before the raylet starts and registers (~1.4 s).
# Here ray.init's Node runs start_api_server in a thread, awaited when the Node's __init__ ends,
# before ray.init reads the URL (the raylet never does; default_worker.py rebuilds it). The
# thread stays parked until shutdown(): the dashboard has PR_SET_PDEATHSIG (fate sharing), fired
# when the *thread* that forked it ends (seen: killed at once). Missing: Ray's order, ~0.5 s.
DASHBOARD_BESIDE_RAYLET = "ray._private.node.Node.start_api_server"
_dashboard_parked = threading.Event()


def _node_class():
    node = _internal("ray._private.node", "Node")
    return node if all(callable(getattr(node, m, None)) for m in (
        "start_api_server", "start_head_processes", "start_ray_processes")) else None


@contextlib.contextmanager
def _dashboard_beside_raylet():
    """During ``ray.init``: ray._private.node.Node is a subclass whose dashboard starts in a
    thread (DASHBOARD_BESIDE_RAYLET)."""
    base, module = _node_class(), _internal("ray._private.node")
    if base is None:
        _lost(DASHBOARD_BESIDE_RAYLET)
        yield
        return

    class Node(base):
        def __init__(self, *args, **kwargs):
            self._dashboard = None  # (done, [error]) once start_api_server ran
            try:
                super().__init__(*args, **kwargs)
            finally:
                if self._dashboard is not None:
                    self._dashboard[0].wait()
                    if self._dashboard[1]:
                        raise self._dashboard[1][0]

        def start_api_server(self, **kwargs):
            done, failed = self._dashboard = threading.Event(), []

            def start():
                try:
                    base.start_api_server(self, **kwargs)
                except BaseException as err:  # noqa: BLE001 - raised again in __init__
                    failed.append(err)
                done.set()
                _dashboard_parked.wait()  # the dashboard's parent thread lives on
            threading.Thread(target=start, name="ray-dashboard", daemon=True).start()

    module.Node = Node
    try:
        yield
    finally:
        module.Node = base


# FALLBACK (2026-12-06). ray.shutdown() ends the processes it started a kind at a time, SIGTERM
# then up to 1 s each; the autoscaler's monitor, after the GCS, spends that second reporting its
# death to the gone GCS (2.60 _private/node.py; `ray stop` ends it first since Ray #30672). It
# is SIGKILLed first (_private/worker.py): 1.2 -> 0.4 s. Missing: Ray's order, 0.8 s slower.
SHUTDOWN_ORDER = "ray._private.worker._global_node"


def shutdown() -> None:
    """``ray.shutdown()`` (the monitor first: SHUTDOWN_ORDER), then the environment as it was
    before ``init_local``."""
    node = getattr(_internal("ray._private.worker"), "_global_node", None)
    for info in (getattr(node, "all_processes", None) or {}).get("monitor", []):
        try:
            info.process.kill()
            info.process.wait(timeout=5)
        except Exception:  # noqa: BLE001 - gone already; Ray's own shutdown does the rest
            pass
    importlib.import_module("ray").shutdown()
    _dashboard_parked.set()  # the dashboard is gone: its parent thread may end
    _dashboard_parked.clear()
    while _saved_env:
        _set_env(_saved_env.pop())


def _set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        os.environ.pop(key, None) if value is None else os.environ.update({key: value})


# FALLBACK. Ray Train's state actor (the dashboard's Train view reads it) started as Ray is up,
# not on the controller's way to the first step; on a running cluster made as Ray's
# get_or_create_state_actor does (2.60 train/v2/_internal/state/state_actor.py) plus
# $RAY_ADDRESS: its 30 s reconciliation asks the State API, else led by a stale address file to
# a dead cluster (runs end ~40 s late, issue #27; GCS_PORT_ENV). One another run made is left
# alone. Missing (or it fails): the controller starts it, a second or two later.
STATE_ACTOR = "ray.train.v2._internal.state.state_actor.get_or_create_state_actor"


def start_train_state_actor(address: str | None = None) -> None:
    """``address``: the GCS of the running cluster the driver joined (None: one it started)."""
    m = _internal("ray.train.v2._internal.state.state_actor")
    if getattr(m, "get_or_create_state_actor", None) is None:
        _lost(STATE_ACTOR)
        return

    def setting(name: str) -> str:  # as Ray reads it, from the creating process's env
        return str(os.getenv(getattr(m, f"{name}_ENV_VAR"), getattr(m, f"DEFAULT_{name}")))
    try:
        if address is None:
            m.get_or_create_state_actor()
            return
        with m._state_actor_lock:
            importlib.import_module("ray").remote(m.TrainStateActor).options(
                num_cpus=0, name=m.TRAIN_STATE_ACTOR_NAME, get_if_exists=True,
                namespace=m.TRAIN_STATE_ACTOR_NAMESPACE, lifetime="detached",
                resources={"node:__internal_head__": 0.001}, scheduling_strategy="DEFAULT",
                max_restarts=-1, max_task_retries=-1,
                runtime_env={"env_vars": {"RAY_ADDRESS": address}}).remote(
                enable_state_actor_reconciliation=setting(
                    "ENABLE_STATE_ACTOR_RECONCILIATION").lower() in ("1", "true"),
                reconciliation_interval_s=float(setting("STATE_ACTOR_RECONCILIATION_INTERVAL_S")))
    except Exception:  # noqa: BLE001 - the controller starts it as before
        pass


# FALLBACK. The autoscaler's node types from the GCS (ray._private.state, no public API); Ray
# 2.60 never writes that key (None on a `ray up` cluster), so driver/preflight.py then reads the
# `ray up` bootstrap config itself. Missing: that bootstrap-config path is taken.
CLUSTER_CONFIG = "ray._private.state.state.get_cluster_config"


def cluster_config():
    """The GCS's autoscaling cluster config, or None."""
    state = _internal("ray._private.state", "state")
    get = getattr(state, "get_cluster_config", None)
    if get is None:
        _lost(CLUSTER_CONFIG)
        return None
    try:
        return get()
    except Exception:  # noqa: BLE001 - an older GCS without the autoscaler state namespace
        return None


# FALLBACK. A TorchTrainer (its private methods, the internal classes below) without what a run
# has no use for (seconds each to the first step on a small machine): DatasetsCallback's actor
# without datasets; PlacementGroupCleanerCallback's detached cleaner where the driver exits right
# after the controller (Ray frees a finished job's groups; kept in Tune trials); requests to Ray
# Data's autoscaling coordinator where no node type can be added (driver/nodes.NodeWatch sizes
# the groups). Missing: Ray's TorchTrainer (a few s to the first step; 60 s start timeouts).
TRAINER_INTERNALS = ("TorchTrainer._create_default_callbacks/_initialize_and_run_controller, "
                     "ray.train.v2._internal callbacks, FixedScalingPolicy, Noop/ResizeDecision")
_CALLBACKS = "ray.train.v2._internal.callbacks"


def _trainer_internals():
    """The classes ``_trainer_classes`` overrides, or None; torch-free (the controller runs it)."""
    trainer = _internal("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer")
    found = (_internal(f"{_CALLBACKS}.datasets", "DatasetsCallback"),
             _internal(f"{_CALLBACKS}.placement_group_callback", "PlacementGroupCleanerCallback"),
             *(_internal("ray.train.v2._internal.execution.scaling_policy", n) for n in (
                 "FixedScalingPolicy", "NoopDecision", "ResizeDecision")))
    if None in found or not all(hasattr(trainer, m) for m in (
            "_create_default_callbacks", "_initialize_and_run_controller")):
        return None
    return found


# FALLBACK (2026-12-06). A Train controller without torch. Ray 2.60's controller imports torch
# (2-3 s of CPU per run and per Tune trial, before it starts the workers) for one reason: the
# TorchConfig and _TorchBackend it unpickles live in ray/train/torch/config.py, which imports
# torch at its top, while their on_start/on_shutdown only ask the workers to run that module's
# functions. TorchBackendConfig (below, torch-free) is that config; its backend takes 2.60's
# _TorchBackend steps for gloo and nccl (init "env") and runs Ray's own functions by name on the
# workers. No Ray issue filed. Missing (or a TPU/hccl backend): Ray's TorchConfig, as before.
# Its group meets at a store rank 0 serves first (worker/rendezvous.py: no 1 s connect backoff).
TORCH_BACKEND = ("ray.train.torch.config._set_torch_distributed_env_vars/_shutdown_torch, "
                 "ray.train.v2._internal.util.TrainingFramework")
_TORCH_CONFIG = "ray.train.torch.config"


def _has_torch_backend() -> bool:
    """Every name TorchBackendConfig's backend uses; ray.train.torch.config's read in its source
    (importing it imports torch, which neither the driver nor the controller needs now)."""
    train = _internal("ray.train")
    try:
        with open(os.path.join(os.path.dirname(train.__file__), "torch", "config.py")) as f:
            source = f.read()
    except (AttributeError, TypeError, OSError):
        return False
    return all(f"\ndef {n}(" in source or f"\nclass {n}" in source for n in (
        "_set_torch_distributed_env_vars", "_shutdown_torch", "TorchConfigContextManager")
               ) and _internal("ray.train.v2._internal.util", "TrainingFramework") is not None


class _TorchContext:
    """On a Train worker: Ray's TorchConfigContextManager around the train function."""

    def __enter__(self):
        self._inner = importlib.import_module(_TORCH_CONFIG).TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


def _join_torch_group(addr: str, port: int, **group) -> None:
    """On a Train worker (it has torch): 2.60 _TorchBackend.on_start's steps."""
    importlib.import_module(_TORCH_CONFIG)._set_torch_distributed_env_vars()
    rendezvous.join(addr, port, **group)


def _leave_torch_group(**kwargs) -> None:
    importlib.import_module(_TORCH_CONFIG)._shutdown_torch(**kwargs)
    rendezvous.leave()


def make_trainer(*args, fixed_cluster: bool, driver_outlives_run: bool, watch=None, **kwargs):
    """``TorchTrainer(*args, **kwargs)`` less the actors above (and without torch where
    TORCH_BACKEND allows); ``watch`` sizes its groups."""
    trainer = _trainer_class()
    if trainer is None:
        from ray.train.torch import TorchTrainer

        _lost(TRAINER_INTERNALS)
        return TorchTrainer(*args, **kwargs)
    return trainer(*args, fixed_cluster=fixed_cluster, driver_outlives_run=driver_outlives_run,
                   watch=watch, **kwargs)


@functools.lru_cache(maxsize=None)
def _trainer_classes() -> dict[str, type] | None:
    """The classes a Train controller unpickles (the scaling policy, the torch-free backend),
    defined once this Ray is known to have what they override; importable as
    ``raytrain.ray_compat.<name>``. Torch-free: the controller runs it."""
    found = _trainer_internals()
    if found is None:
        return None
    import dataclasses

    import ray
    from ray.train.backend import Backend, BackendConfig

    _, _, fixed_policy, noop, resize = found

    class ClusterPolicy(fixed_policy):
        """Fixed or elastic on a cluster that cannot grow, sized by ``self.watch``."""

        after_controller_start = _maybe_send_resource_request = _send_resource_request = \
            _cancel_resource_request = lambda self, *args: None  # no coordinator to ask

        def _decide(self, n: int | None):
            per = self.scaling_config._resources_per_worker_not_none
            return noop() if n is None else resize(num_workers=n, resources_per_worker=per)

        def make_decision_for_non_running_worker_group(self):
            return self._decide(self.watch.start())

        def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
            return self._decide(self.watch.grow(worker_group_state.num_workers))

    class TorchBackend(Backend):
        """2.60's _TorchBackend for gloo and nccl, its worker-side steps run by name."""

        share_cuda_visible_devices = True

        def on_start(self, worker_group, backend_config):
            addr, port = worker_group.execute_single(0, rendezvous.serve,
                                                     backend_config.timeout_s)
            n = len(worker_group)
            ray.get([worker_group.execute_single_async(
                rank, _join_torch_group, addr, port, backend=backend_config.backend,
                world_rank=rank, world_size=n, timeout_s=backend_config.timeout_s)
                for rank in range(n)])

        def on_shutdown(self, worker_group, backend_config):
            from ray.train import constants as c

            timeout = float(os.environ.get(c.TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                           c.DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
            done = worker_group.execute_async(_leave_torch_group,
                                              destroy_process_group=len(worker_group) > 1)
            try:
                ray.get(done, timeout=timeout)
            except ray.exceptions.GetTimeoutError:  # as Ray's _TorchBackend: warn, go on
                logging.getLogger(__name__).warning(
                    "Torch process group shutdown timed out after %s seconds", timeout)

    @dataclasses.dataclass
    class TorchBackendConfig(BackendConfig):
        """TorchConfig's fields, without torch (TorchTrainer sets ``backend``)."""

        backend: str | None = None
        init_method: str = "env"
        timeout_s: int = 1800

        @property
        def backend_cls(self):
            if self.backend not in ("gloo", "nccl"):  # TPU, hccl: Ray's own backend
                return importlib.import_module(_TORCH_CONFIG)._TorchBackend
            return TorchBackend

        @property
        def train_func_context(self):  # read on the driver, entered on the workers
            return _TorchContext

        @property
        def framework(self):
            return _internal("ray.train.v2._internal.util", "TrainingFramework").TORCH

        def to_dict(self) -> dict[str, Any]:
            return dataclasses.asdict(self)

    classes = {"ClusterPolicy": ClusterPolicy, "TorchBackend": TorchBackend,
               "TorchBackendConfig": TorchBackendConfig}
    for name, cls in classes.items():
        cls.__module__, cls.__qualname__ = __name__, name
    return classes


@functools.lru_cache(maxsize=None)
def _trainer_class() -> type | None:
    """``Trainer``: TorchTrainer less the actors above; a DataParallelTrainer with
    TorchBackendConfig (torch-free) where TORCH_BACKEND allows, else over Ray's TorchTrainer."""
    classes = _trainer_classes()
    if classes is None:
        return None
    torch_free = _has_torch_backend()
    if torch_free:
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer as base
    else:
        _lost(TORCH_BACKEND)
        from ray.train.torch import TorchTrainer as base

    datasets_cb, cleaner_cb = _trainer_internals()[:2]
    policy, backend = classes["ClusterPolicy"], classes["TorchBackendConfig"]

    class Trainer(base):
        """``TorchTrainer`` without the actors above."""

        def __init__(self, *args, fixed_cluster, driver_outlives_run, watch=None, **kwargs):
            if torch_free:  # as TorchTrainer names it
                gpu = getattr(kwargs.get("scaling_config"), "use_gpu", False)
                kwargs["backend_config"] = backend(backend="nccl" if gpu else "gloo")
            super().__init__(*args, **kwargs)
            self.driver_outlives_run = driver_outlives_run
            self.watch = watch if fixed_cluster else None  # None: Ray's own scaling policies

        def _create_default_callbacks(self):
            drop: tuple[type, ...] = () if self.datasets else (datasets_cb,)
            if not self.driver_outlives_run:
                drop += (cleaner_cb,)
            return [cb for cb in super()._create_default_callbacks()
                    if not isinstance(cb, drop)]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            if self.watch is not None:  # in place of Ray's fixed or elastic one
                scaling = controller_init_kwargs["scaling_policy"] = policy(self.scaling_config)
                scaling.watch = self.watch
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    Trainer.__module__, Trainer.__qualname__ = __name__, "Trainer"
    return Trainer


def __getattr__(name: str) -> Any:  # raytrain.ray_compat.Trainer / .ClusterPolicy / ...
    if name == "Trainer" and _trainer_class() is not None:
        return _trainer_class()
    classes = _trainer_classes() if name in ("ClusterPolicy", "TorchBackend",
                                             "TorchBackendConfig") else None
    if classes is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return classes[name]


# ---------------------------------------------------------------------------- Tune side


# FALLBACK. Placement groups of dead Train controllers (tune/placement.py): a trial Tune ends
# takes its controller along, which never removes its workers' group, kept until the driver's
# job ends; 2.60's PlacementGroupCleaner fails with several clusters on a machine (Ray #54305).
# Found by creator in the GCS table (ray._private.state), removed by id (ray._raylet), the
# controllers recorded by a WorkerGroupCallback. Missing: a search may hold ended trials' CPUs.
PLACEMENT_GROUPS = ("the placement-group table (ray._private.state, ray._raylet."
                    "PlacementGroupID) and WorkerGroupCallback")


def worker_group_callback_base() -> type:
    """Base class of a Train-controller callback called before a worker group starts."""
    base = _internal("ray.train.v2._internal.execution.callback", "WorkerGroupCallback")
    return base if base is not None else object


def has_placement_group_table() -> bool:
    state = _internal("ray._private.state", "state")
    return (state is not None and hasattr(state, "_connect_and_get_accessor")
            and _internal("ray._raylet", "PlacementGroupID") is not None
            and _internal("ray.core.generated.gcs_pb2", "PlacementGroupTableData") is not None
            and worker_group_callback_base() is not object)


def can_reap_placement_groups() -> bool:
    if has_placement_group_table():
        return True
    _lost(PLACEMENT_GROUPS)
    return False


def live_placement_groups() -> list[tuple[str, str, bool]]:
    """(id, creator actor id, creator dead) of each group not removed (the GCS table)."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = gcs_pb2.PlacementGroupTableData
    rows = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        pg = table.FromString(raw)
        if pg.state != table.REMOVED:
            rows.append((pg.placement_group_id.hex(), pg.creator_actor_id.hex(),
                         pg.creator_actor_dead))
    return rows


def remove_placement_group(pg_hex: str) -> None:
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group as remove

    remove(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_hex))))


# FALLBACK. ASHA's late check (tune/asha.py): Ray's ASHA decides once per rung, so trials racing
# through rungs together all go on; the check re-asks at later reports, reading the scheduler's
# _trial_info/_metric/_time_attr/_num_stopped and the bracket's _rungs/cutoff() (tune/
# schedulers/async_hyperband.py). Missing: Ray's plain ASHA alone (more trials run to the end).
ASHA_INTERNALS = "ASHAScheduler._trial_info/_metric/_time_attr and _Bracket._rungs/cutoff"


def has_asha_internals() -> bool:
    bracket = _internal("ray.tune.schedulers.async_hyperband", "_Bracket")
    asha = _internal("ray.tune.schedulers", "ASHAScheduler")
    if bracket is None or asha is None or not hasattr(bracket, "cutoff"):
        return False
    probe = asha(time_attr="epoch", metric="m", mode="min", max_t=2, grace_period=1)
    b = next(iter(getattr(probe, "_brackets", [])), None)
    return all(hasattr(probe, a) for a in ("_trial_info", "_metric", "_time_attr",
                                           "_num_stopped")) and hasattr(b, "_rungs")


def asha_rungs(scheduler, trial_id: str) -> tuple[list, Callable] | None:
    """(the rungs [(milestone, {trial_id: value})] of the trial's bracket, its cutoff
    function), or None without the internals (the late check is then skipped)."""
    try:
        bracket = scheduler._trial_info[trial_id]
        return bracket._rungs, bracket.cutoff
    except (AttributeError, KeyError):
        _lost(ASHA_INTERNALS)
        return None


def asha_bracket(grace_period: int, max_t: int, reduction_factor: int):
    """One ASHA bracket (the private ``_Bracket`` every rung decision of Ray's ASHA goes
    through), for benchmarks/asha_replay.py to replay measured curves offline. Missing: the
    replay cannot run (one RaytrainError); training never uses it."""
    bracket = _internal("ray.tune.schedulers.async_hyperband", "_Bracket")
    if bracket is None:
        raise RaytrainError(f"this Ray has no ASHA _Bracket (written for {WRITTEN_FOR}): the "
                            "replay needs it")
    return bracket(grace_period, max_t, reduction_factor, 0)


def asha_setting(scheduler, name: str) -> Any:
    """ASHA's ``metric`` / ``time_attr`` (kept privately as _metric, _time_attr)."""
    return getattr(scheduler, f"_{name}", None)


def asha_count_stopped(scheduler) -> None:
    scheduler._num_stopped = getattr(scheduler, "_num_stopped", 0) + 1


# FALLBACK. The Trials of a finished search, with their statuses: ResultGrid has no public
# per-trial status; its private _experiment_analysis has the Trials. Missing: the Trials are
# read back from the experiment state Tune saved (ray.tune.ExperimentAnalysis, public).
RESULT_GRID_TRIALS = "ResultGrid._experiment_analysis"


def result_grid_trials(grid) -> list:
    analysis = getattr(grid, "_experiment_analysis", None)
    if analysis is None:
        _lost(RESULT_GRID_TRIALS)
        analysis = importlib.import_module("ray.tune").ExperimentAnalysis(grid.experiment_path)
    return list(analysis.trials)


# ---------------------------------------------------------------------------- Ray Data side


# FALLBACK. The epoch of a streamed dataset (data/decode.py): DataContext's private
# ``_execution_idx`` counts a dataset's executions (data/context.py; shuffles reseed from it),
# one per epoch under Train: decode tasks seed crops with it; a group resumed from epoch N sets
# it to N, so epoch N+1 is shuffled and cropped as uninterrupted. Missing: crops seeded by (seed,
# image) alone, a resumed run reshuffles from epoch 1's order; each image still once an epoch.
DATA_EXECUTION_INDEX = "DataContext._execution_idx"


def data_execution_index() -> int:
    """The running Ray Data execution's index (0 when this Ray does not keep one)."""
    from ray.data import DataContext

    idx = getattr(DataContext.get_current(), "_execution_idx", None)
    if idx is None:
        _lost(DATA_EXECUTION_INDEX)
        return 0
    return int(idx)


def set_data_execution_index(context, index: int) -> None:
    """Start ``context``'s execution count at ``index`` (a resumed run's next epoch - 1)."""
    if hasattr(context, "_execution_idx"):
        context._execution_idx = int(index)
    else:
        _lost(DATA_EXECUTION_INDEX)


def _has_data_execution_index() -> bool:
    from ray.data import DataContext

    return hasattr(DataContext.get_current(), "_execution_idx")


REQUIRED: dict[str, Callable[[], bool]] = {STORAGE_CONTEXT: _has_storage_context}
FALLBACKS: dict[str, tuple[Callable[[], bool], str]] = {
    TRAIN_CONTEXT_LOGGER: (lambda: _internal(TRAIN_CONTEXT_LOGGER) is not None,
                           "Ray Train's per-report INFO lines are not silenced"),
    STATE_ACTOR: (lambda: _internal("ray.train.v2._internal.state.state_actor",
                                    "get_or_create_state_actor") is not None,
                  "the Train state actor starts with the controller, later"),
    CLUSTER_CONFIG: (lambda: hasattr(_internal("ray._private.state", "state"),
                                     "get_cluster_config"),
                     "autoscaling node types come from the `ray up` bootstrap config only"),
    TRAINER_INTERNALS: (lambda: _trainer_internals() is not None,
                        "Ray Train's own TorchTrainer runs, with its dataset manager, "
                        "placement-group cleaner and autoscaling requests"),
    TORCH_BACKEND: (_has_torch_backend, "each Train controller imports torch (2-3 s of CPU "
                    "per run and trial, before its workers start)"),
    PLACEMENT_GROUPS: (has_placement_group_table, "placement groups of ended trials are not "
                       "removed until the search ends; later trials may wait for their CPUs"),
    SETUP_HOOK_ENV: (lambda: bool(setup_hook_env("x")), "Train workers import as they go"),
    PRESTART: (lambda: _prestart_internals() is not None,
               "Train worker processes start when the controller asks for them (1.5-2 s later)"),
    CHECKPOINT_SNAPSHOT: (lambda: _internal("ray.train.v2._internal.constants",
                                            "CHECKPOINT_MANAGER_SNAPSHOT_FILENAME") is not None,
                          "every complete checkpoint directory counts as Ray's; unregistered "
                          "ones are not pruned"),
    GCS_PORT_ENV: (lambda: _internal("ray._private.ray_constants",
                                     "GCS_PORT_ENVIRONMENT_VARIABLE") is not None,
                   "a new local cluster may follow a stale /tmp/ray address file (runs end late)"),
    LOCAL_CPUS: (lambda: _internal("ray._private.utils", "get_num_cpus") is not None,
                 "a local cluster's CPUs are counted with os.cpu_count()"),
    DASHBOARD_BESIDE_RAYLET: (lambda: _node_class() is not None,
                              "a new local cluster starts its raylet after its dashboard is "
                              "up (~1 s later)"),
    SHUTDOWN_ORDER: (lambda: hasattr(_internal("ray._private.worker"), "_global_node"),
                     "a local cluster's shutdown takes ~0.8 s longer"),
    ASHA_INTERNALS: (has_asha_internals, "Ray's plain ASHA runs, without raytrain's late check"),
    DATA_EXECUTION_INDEX: (_has_data_execution_index,
                           "streamed crops are seeded by (seed, image) alone and a resumed run "
                           "reshuffles from epoch 1's order"),
    RESULT_GRID_TRIALS: (lambda: "_experiment_analysis" in getattr(
        _internal("ray.tune", "ResultGrid"), "__init__", lambda: None).__code__.co_names,
        "trial statuses are read back from the saved state"),
}
