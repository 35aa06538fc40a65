"""The Ray Data pipeline: decode + crop in CPU tasks across the cluster, inference in a pool of
actors that each hold the model once, rows streamed back to the driver.

    plan = size_layout(cluster_cpus, cluster_gpus, num_workers=2, use_gpu=False)
    ds = build_dataset(spec, weights, found, plan, batch_size=256, top_k=5)
    for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"): ...

Images: ``ray.data.range(tasks)`` -> ``map_batches(ListingRows(DecodeRows))`` (the training
path's fused listing+decode operator, unshuffled), Parquet: ``read_parquet`` ->
``map_batches(DecodeRows)``. Either way a task reads its files and decodes them with PIL into
the eval crop ``evaluate`` uses (short side to N*256/224, centre N; JPEG draft mode), uint8.
A file that cannot be read or decoded is a zero image with its reason in ``error``: it never
fails the task (Ray would retry it, then fail the whole dataset).
Then ``map_batches(Predictor, concurrency=N)``: an actor pool of N, each with --cpus-per-worker
CPUs (and a GPU with --use-gpu); Ray Data's streaming executor keeps both stages bounded by its
object-store budget (backpressure), so memory does not grow with the number of images.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np

from raytrain.data.decode import decode_crop, image_bytes, why_unreadable
from raytrain.errors import ConfigError, RaytrainError

ROWS_PER_TASK = 64  # images per decode task: the training path's decode batch


class Plan(NamedTuple):
    num_workers: int
    cpus_per_worker: float
    use_gpu: bool
    data_cpus: float  # CPUs the actors leave for the decode tasks


def size_layout(cluster_cpus: float, cluster_gpus: float, num_workers: int, use_gpu: bool,
                cpus_per_worker: float | None = None, data_cpus: float | None = None) -> Plan:
    """Resources of the actor pool, refused in one line when the cluster cannot run it: more
    GPUs than it has, or actors holding every CPU (the decode tasks would never run: Ray Data
    waits, it does not fail; the ingest notes saw an actor pool sized to the CPUs hang).
    Without --cpus-per-worker an actor takes 1 CPU, or less where 1 would leave the decode
    tasks under --data-cpus (default 1), as training's workers do (preflight.size_data_cpus)."""
    from raytrain.data.pipeline import check_data_cpus

    if use_gpu and num_workers > cluster_gpus:
        raise ConfigError("num_workers", num_workers, f"at most {cluster_gpus:g} with --use-gpu "
                          f"(one GPU per worker; the cluster has {cluster_gpus:g} GPUs)")
    want = data_cpus or 1.0
    if cpus_per_worker is None:
        share = (cluster_cpus - want) / num_workers
        cpus_per_worker = min(1.0, math.floor(share * 100) / 100) if share >= 0.01 else 1.0
    left = check_data_cpus(cluster_cpus, num_workers, cpus_per_worker, want)
    return Plan(num_workers, cpus_per_worker, use_gpu, math.floor(left * 100) / 100)


def read_each(fs, paths) -> list:
    """Each file's bytes, or the exception reading it raised (a file gone since the listing,
    unreadable): one bad file is one bad row, not a failed task. Threads for object stores."""
    import pyarrow.fs as pafs

    def one(p):
        try:
            with fs.open_input_stream(p) as f:
                return f.read()
        except Exception as err:  # OSError, FileNotFoundError, pyarrow's ArrowIOError ...
            return err

    if not isinstance(fs, pafs.LocalFileSystem) and len(paths) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, paths))
    return [one(p) for p in paths]


class DecodeRows:
    """Ray Data task function: rows (``path``, or ``image`` bytes) -> ``image`` uint8
    [B, 3, N, N] eval crops, ``path``, ``error`` ("" for a good image). ``prefix``: put before
    the paths written (``s3://``: pyarrow's paths in a bucket have no scheme)."""

    def __init__(self, fs, size: int, prefix: str = "", draft: bool = True):
        self.fs, self.size, self.prefix, self.draft = fs, size, prefix, draft

    def __call__(self, batch: dict) -> dict:
        if "image" in batch:
            datas = image_bytes(batch["image"])
        else:
            datas = read_each(self.fs, list(batch["path"]))
        n = len(datas)
        paths = [str(p) for p in batch["path"]] if "path" in batch else [""] * n
        if self.prefix and "image" not in batch:
            paths = [self.prefix + p for p in paths]
        out = np.zeros((n, self.size, self.size, 3), np.uint8)
        errors = [""] * n
        for i, data in enumerate(datas):
            try:
                if isinstance(data, BaseException):
                    raise data
                out[i] = decode_crop(data, self.size, False, None, self.draft)
            except Exception as err:  # PIL raises many kinds for a corrupt or truncated file
                errors[i] = why_unreadable(err)
        return {"image": np.ascontiguousarray(out.transpose(0, 3, 1, 2)),
                "path": np.array(paths, dtype=object), "error": np.array(errors, dtype=object)}


class Predictor:
    """The actor: the model loaded once (from the object store), then batches of crops ->
    a pyarrow table of predictions. On CUDA: channels_last, and bf16 autocast where the GPU
    supports it; on CPU fp32 (bf16 autocast is slower on CPUs without AMX)."""

    def __init__(self, spec: dict, weights_ref: list, use_gpu: bool, top_k: int):
        import ray
        import torch

        from raytrain.data.builtin import Augment
        from raytrain.models import build_model

        self.device = torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")
        cuda = self.device.type == "cuda"
        self.names = spec["class_names"]
        model = build_model(spec["model"], len(self.names), stem=spec["stem"],
                            image_size=spec["image_size"])
        model.load_state_dict(ray.get(weights_ref[0]))
        self.model = model.eval().to(self.device)
        if cuda:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.amp = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else None
        self.aug = Augment(spec["mean"], spec["std"], self.device, channels_last=cuda)
        self.k = max(1, min(top_k, len(self.names)))
        self.top_k = top_k

    def __call__(self, batch: dict):
        import torch

        with warnings.catch_warnings():  # Ray's batch is read-only; nothing here writes it
            warnings.simplefilter("ignore", UserWarning)
            x = torch.from_numpy(np.ascontiguousarray(batch["image"]))
        x = x.to(self.device, non_blocking=True)
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=self.amp,
                                                    enabled=self.amp is not None):
            probs = torch.softmax(self.model(self.aug(x)).float(), dim=1)
            top_p, top_i = probs.topk(self.k, dim=1)
        return self.table(batch, top_p.cpu().numpy(), top_i.cpu().numpy())

    def table(self, batch: dict, top_p: np.ndarray, top_i: np.ndarray):
        import pyarrow as pa

        errors = [str(e) for e in batch["error"]]
        ok = np.array([not e for e in errors])
        names = np.array(self.names, dtype=object)
        label = pa.array(top_i[:, 0].astype(np.int64), mask=~ok)
        cols = {"path": pa.array([str(p) for p in batch["path"]], pa.string()),
                "class": pa.array(names[top_i[:, 0]], pa.string(), mask=~ok),
                "label": label,
                "prob": pa.array(top_p[:, 0].astype(np.float32), mask=~ok)}
        if self.top_k > 1:
            cols["topk_class"] = pa.array([list(names[r]) if g else None
                                           for r, g in zip(top_i, ok)], pa.list_(pa.string()))
            cols["topk_prob"] = pa.array([r.tolist() if g else None for r, g in zip(top_p, ok)],
                                         pa.list_(pa.float32()))
        cols["error"] = pa.array(errors, pa.string())
        return pa.table(cols)


def build_dataset(spec, weights: dict, found, plan: Plan, batch_size: int, top_k: int,
                  wait_timeout: float = 60.0):
    """The lazy Dataset of prediction rows (nothing runs until it is iterated). Its actors
    must all start within ``wait_timeout`` s, else the run fails (``run_failed`` words it):
    Ray Data's default waits for them forever, and a cluster whose CPUs other jobs hold then
    hangs."""
    import ray
    import ray.data

    from raytrain import storage
    from raytrain.data.pipeline import fast_context, listing_dataset

    fs = storage.resolve_fs(found.data_dir, "data_dir")[0]
    prefix = f"{storage.scheme(found.data_dir)}://" if storage.is_uri(found.data_dir) else ""
    decode = DecodeRows(fs, spec.image_size, prefix)
    if found.kind == "images":
        ds = listing_dataset(found.table, ROWS_PER_TASK, shuffle=False, seed=0, fn=decode)
    else:
        columns = ["image", "path"] if found.has_path else ["image"]
        # Without a path column each row is named by its file (include_paths)
        ds = ray.data.read_parquet(found.files, filesystem=fs, columns=columns,
                                   include_paths=not found.has_path)
        ds = ds.map_batches(decode, batch_size=ROWS_PER_TASK, batch_format="numpy")
    ds = ds.map_batches(
        Predictor, batch_size=batch_size, batch_format="numpy", zero_copy_batch=True,
        fn_constructor_args=(spec.to_dict(), [ray.put(weights)], plan.use_gpu, top_k),
        compute=ray.data.ActorPoolStrategy(size=plan.num_workers),
        num_cpus=plan.cpus_per_worker,
        num_gpus=1 if plan.use_gpu else None, memory=actor_memory(weights, batch_size, spec))
    ds.context.wait_for_min_actors_s = wait_timeout
    return fast_context(ds)


def actor_memory(weights: dict, batch_size: int, spec) -> int:
    """Bytes an actor holds: the weights twice (the fetched state dict, the model), a uint8 and
    a float copy of its batch. Asked for explicitly also so that the decode operator is not
    fused into the actors: with equal remote args Ray 2.60 fuses a task map into the next
    actor map (seen: one 'MapWorker(MapBatches(ListingRows)->MapBatches(Predictor))'
    operator), and every image was then decoded inside the N actors while the CPUs left for
    decoding sat idle."""
    params = sum(t.numel() * t.element_size() for t in weights.values())
    return int(2 * params + 5 * batch_size * 3 * spec.image_size ** 2) + 64 * 2**20


def run_failed(err: BaseException, plan: Plan, wait_timeout: float) -> RaytrainError:
    import ray.exceptions

    from raytrain.errors import TrainingError, short

    if isinstance(err, ray.exceptions.GetTimeoutError):  # the actors' start (build_dataset)
        gpu = " + 1 GPU" if plan.use_gpu else ""
        return TrainingError(f"prediction failed: --wait-timeout {wait_timeout:g}s: no room on "
                             f"the cluster for {plan.num_workers} worker(s) x "
                             f"{plan.cpus_per_worker:g} CPU{gpu} (other jobs hold its "
                             "resources?); nothing was written")
    return TrainingError(f"prediction failed: {short(err)}")
