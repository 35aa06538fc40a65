"""Checks before anything starts: the inputs (once, on the driver; --dry-run runs them too)
and the shape of the Ray cluster a run lands on (resources, autoscaler, storage).

    from raytrain.driver.preflight import check_inputs, preflight
    check_inputs(cfg)          # a bad --pretrained/--data-dir/--storage-path: one line, exit 2
    with ray_compat_checked(): # Ray's internals, checked while the cluster starts
        connect(...)
    shape = preflight(cfg)     # on a connected cluster: fails in seconds if workers can't fit
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from typing import Any, NamedTuple

import yaml

from raytrain import ray_compat, storage
from raytrain.config import NUM_CLASSES, TrainConfig
from raytrain.errors import ConfigError, RaytrainError

# URI schemes that name storage every node reaches (pyarrow filesystems Ray Train writes to).
# file:// is a local path in URI form, so it does not count.
LOCAL_SCHEMES = ("", "file")


def check_storage_for_multinode(storage_path: str, nodes: list[dict[str, Any]],
                                shared: bool) -> None:
    """Refuse a node-local ``--storage-path`` when the cluster spans more than one host.

    Ray Train workers write checkpoints to ``storage_path`` on their own machine and the driver
    reads them (and writes the run files) on its machine: with a local path on several hosts
    each keeps a piece of the run, and resuming or exporting the model fails later. Several
    Ray nodes on one host (``ray start`` twice, ``ray.cluster_utils.Cluster``) share its disk
    and are fine. ``nodes`` is ``ray.nodes()`` (entries marked not ``Alive`` are ignored);
    hosts are told apart by ``NodeManagerAddress``. ``shared=True`` (``--shared-storage``)
    says the local path is an NFS/Lustre/... mount present on every host.

    An autoscaling cluster can grow after this check: on one started by ``ray up`` the head is
    often the only node when a job starts, so point --storage-path at shared storage there.
    """
    scheme = storage_path.split("://", 1)[0].lower() if "://" in storage_path else ""
    if shared or scheme not in LOCAL_SCHEMES:
        return
    alive = [n for n in nodes if n.get("Alive", True)]
    hosts = {n.get("NodeManagerAddress") for n in alive}
    if len(hosts) <= 1:
        return
    raise RaytrainError(
        f"--storage-path {storage_path}: node-local disk, but the workers may run on "
        f"{len(alive)} nodes on {len(hosts)} hosts; use shared storage (an EFS/NFS "
        "mount) or pass --shared-storage if this path is shared")


def check_inputs(cfg: TrainConfig, dry_run: bool = False) -> None:
    """Every check that needs more than the config's own fields, run once on the driver before
    any Ray process starts (never in workers or Tune trials, which rebuild the config). A
    --dry-run runs them all, except loading a dataset that would be downloaded first and
    the local cluster's resources. Every failing check is reported: one RaytrainError, a line
    each."""
    problems: list[str] = []

    def attempt(check, *args, **kwargs) -> None:
        try:
            check(*args, **kwargs)
        except RaytrainError as err:
            problems.append(str(err))

    d = cfg.data
    num_classes = NUM_CLASSES.get(d.dataset)
    if d.streaming:  # list the images now (cached for the run): a bad layout fails here
        try:
            num_classes = check_streamed_data(cfg)
        except RaytrainError as err:
            problems.append(str(err))
            num_classes = None
    if cfg.model.pretrained and num_classes:  # loaded once here: a bad file fails before Ray
        from raytrain.models import build_model

        attempt(build_model, cfg.model.model, num_classes, cfg.model.pretrained,
                cfg.model.stem, d.image_size)
    attempt(check_storage_writable, cfg.run.storage_path, create=False)  # the run creates it
    if not dry_run or cfg.data.data_dir is not None:
        attempt(check_data, cfg)
    if not dry_run:  # a plan may be for a cluster it names later
        attempt(check_local_resources, cfg)
    else:  # a run checks Ray's internals beside Ray's start (ray_compat_checked)
        attempt(ray_compat.check)
    # No torch in the driver after ray.init (only --pretrained and --use-gpu import it, above):
    # its libraries take static TLS, and dlopened after what ray.init loads in a `ray job
    # submit` driver they failed ("Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so";
    # CI, 2026-12-05). model.pt comes from rank 0 (driver/run.py export_model).
    if problems:
        raise RaytrainError("\n".join(problems))


@contextlib.contextmanager
def ray_compat_checked():
    """``ray_compat.check()`` in a thread while the body starts or joins the cluster: it imports
    Ray Train (pandas, Ray Data: 0.8 s of a 4.2 s "Ray up" on 2 cores, measured 2026-12-07),
    while ``ray.init`` mostly waits on Ray's processes. A missing internal is then raised here,
    after the body (the caller stops the cluster it started); anything else the thread met (an
    import racing ray.init's) is checked again on this thread. No torch in either."""
    failed: list[BaseException] = []

    def check() -> None:
        try:
            ray_compat.check()
        except BaseException as err:  # noqa: BLE001 - raised or retried on the caller's thread
            failed.append(err)

    thread = threading.Thread(target=check, name="raytrain-compat-check", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if failed and isinstance(failed[0], RaytrainError):
        raise failed[0]
    if failed:
        ray_compat.check()


def check_local_resources(cfg: TrainConfig) -> None:
    """Without --address/$RAY_ADDRESS raytrain starts a local cluster of this machine's CPUs
    (and GPUs): workers that cannot fit on it are refused before it starts. A cluster already
    connected, or elastic MIN:MAX workers (they wait --wait-timeout), is left to preflight()."""
    c = cfg.cluster
    ray = sys.modules.get("ray")
    if c.address or os.environ.get("RAY_ADDRESS") or isinstance(c.num_workers, tuple) or (
            ray is not None and ray.is_initialized()):
        return
    cpus = ray_compat.local_cpus()
    gpus = 0
    if c.use_gpu:
        import torch

        gpus = torch.cuda.device_count()
    if cfg.data.streaming:  # workers and Ray Data's CPUs as preflight() will size them
        import copy

        trial = copy.deepcopy(cfg)
        size_data_cpus(trial, cpus)
        c = trial.cluster
    need = {"CPU": c.worker_cpus} | ({"GPU": 1.0} if c.use_gpu else {})
    room = fits({"CPU": cpus, "GPU": gpus}, need)
    if room < c.min_workers:
        asked = " + ".join(f"{v:g} {k}" for k, v in need.items())
        raise RaytrainError(
            f"--num-workers {c.min_workers} needs {c.min_workers} x ({asked}) per worker; "
            f"this machine has {cpus:g} CPUs, {gpus} GPUs for the local cluster raytrain "
            f"starts, room for {room}. Lower --num-workers/--cpus-per-worker"
            + (", drop --use-gpu" if c.use_gpu else "") + ", or pass --address of a cluster")


def check_streamed_data(cfg: TrainConfig) -> int:
    """Your own images: list them (cached for the run), check the batch fills and the model
    takes the size. Returns the number of classes."""
    from raytrain.data.listing import list_dataset
    from raytrain.models import check_input_size

    d = cfg.data
    listing = list_dataset(d.dataset, d.data_dir)
    num_classes, n_train = len(listing.class_names), listing.counts["train"]
    workers = cfg.cluster.max_workers
    key, sizes = (("batch_sizes", cfg.tune.batch_size_choices()) if cfg.tune.tune else
                  ("batch_size", [cfg.optim.batch_size]))
    if n_train // workers < max(sizes) // workers:
        raise ConfigError(key, ",".join(map(str, sizes)), f"at most "
                          f"{n_train // workers * workers} (the {n_train} training images in "
                          f"{d.data_dir} over {workers} worker(s) would not fill one batch)")
    check_input_size(cfg.model.model, num_classes, cfg.model.stem, d.image_size)
    return num_classes


def check_storage_writable(storage_path: str, create: bool = True) -> None:
    """--storage-path can hold run directories. ``create=False`` (before Ray starts, and
    --dry-run) leaves nothing: it tries the nearest existing directory on the path instead.
    A bucket URI: one small object is written and deleted (what the run's credentials allow)."""
    if storage.is_uri(storage_path):
        try:
            storage.check_writable(storage_path)
        except OSError as err:
            raise RaytrainError(f"--storage-path {storage_path}: not writable "
                                f"({storage.first_line(err)})") from None
        return
    try:
        if create:
            os.makedirs(storage_path, exist_ok=True)
            probe = os.path.join(storage_path, f".raytrain-write-test-{os.getpid()}")
            open(probe, "w").close()
            os.remove(probe)
            return
        parent, child = storage_path, None
        while not os.path.exists(parent):
            parent, child = os.path.dirname(parent), parent
        if not os.path.isdir(parent):
            raise NotADirectoryError(20, f"{parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied" if not _read_only_fs(parent)
                                  else "Read-only file system")
        # os.access trusts root everywhere (/proc, /sys): try it, and leave nothing behind
        if child is not None:
            os.mkdir(child)
            os.rmdir(child)
        else:
            probe = os.path.join(parent, f".raytrain-write-test-{os.getpid()}")
            open(probe, "w").close()
            os.remove(probe)
    except OSError as err:
        raise RaytrainError(f"--storage-path {storage_path}: not writable "
                            f"({err.strerror})") from None


def _read_only_fs(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


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
    config = ray_compat.cluster_config()
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
    size_data_cpus(cfg, ray.cluster_resources().get("CPU", 0.0))
    groups = autoscaling_groups()
    use_gpu = resolve_gpu(cfg, groups)
    need = {"CPU": c.worker_cpus} | ({"GPU": 1.0} if use_gpu else {})
    can_grow = any(fits(g["resources"], need) for g in groups)
    if groups:  # nodes that join later are other hosts: a local path would be split
        check_storage_for_multinode(cfg.run.storage_path, [
            {"Alive": True, "NodeManagerAddress": "head"},
            {"Alive": True, "NodeManagerAddress": "autoscaled"}], cfg.run.shared_storage)
    patient = can_grow or isinstance(c.num_workers, tuple)
    deadline = time.monotonic() + (c.wait_timeout if patient else 0)
    requested = False
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        placeable = sum(fits(n["Resources"], need) for n in alive)
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
    check_storage_for_multinode(cfg.run.storage_path, alive, cfg.run.shared_storage)
    return Shape(use_gpu=use_gpu, one_host=len(alive) == 1 and not groups, can_grow=can_grow)


def size_data_cpus(cfg: TrainConfig, cluster_cpus: float) -> None:
    """Streamed data: CPUs for Ray Data's read/decode tasks beside the workers', set on ``cfg``.

    Ray Data schedules its tasks on CPUs the Train workers do not hold; with every CPU held the
    pipeline never starts (a hang, not an error). Without --cpus-per-worker a worker takes 1
    CPU, or less where that leaves Ray Data under --data-cpus (default 1): 2 workers on this
    2-CPU machine get 0.5 each. --data-cpus then defaults to every CPU the workers leave (per
    run: Tune trials at once each stream their own data). An explicit layout that leaves less
    is refused here, in one line."""
    c, d = cfg.cluster, cfg.data
    if not d.streaming:
        return
    from raytrain.data.pipeline import check_data_cpus

    runs = cfg.tune.max_concurrent_trials or 1 if cfg.tune.tune else 1
    want = d.data_cpus or 1.0
    if c.cpus_per_worker is None:
        share = (cluster_cpus / runs - want) / c.max_workers
        c.cpus_per_worker = min(1.0, math.floor(share * 100) / 100) if share >= 0.01 else 1.0
    left = check_data_cpus(cluster_cpus, c.max_workers, c.worker_cpus, want, runs)
    if d.data_cpus is None:
        d.data_cpus = math.floor(left * 100) / 100


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


def fits(node: dict[str, float], need: dict[str, float]) -> int:
    """How many workers needing ``need`` fit on a node with ``node`` resources (the one
    "does it fit" of raytrain: preflight, Tune's concurrent trials)."""
    return int(min(node.get(k, 0.0) // v for k, v in need.items()))
