"""Input pipeline throughput (input only, no model): torchvision ImageFolder + DataLoader vs
raytrain's Ray Data streaming path (decode in Ray Data tasks) vs worker-side batched
``torchvision.io.decode_jpeg``, on one generated folder of photo-like JPEGs.

    python benchmarks/folder_ingest.py --quick                     # smoke: 96 images, crop 32
    python benchmarks/folder_ingest.py --images 1500 --sizes 64,224

Rates are images/s over the last epoch (the first includes start-up). "First batch" is given
twice: cold, from building the pipeline (listing included, Ray start-up excluded; the
DataLoader forks its workers) to the first batch of the first epoch; warm, from the start of
the last epoch to its first batch (persistent DataLoader workers; a new Ray Data execution).
The single-core rows are PIL decode + RandomResizedCrop in this process: the per-core limit.
Ray runs with ``num_cpus=2`` (this machine's cores); the Ray Data decode tasks use both.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain.data.decode import decode_crop  # noqa: E402
from raytrain.data.listing import list_image_folder  # noqa: E402
from raytrain.data.pipeline import build_datasets  # noqa: E402
from raytrain.data.sources import IMAGENET_MEAN, IMAGENET_STD, iter_batches  # noqa: E402


def generate(root: str, n: int, seed: int = 0) -> None:
    """Photo-like JPEGs ~300-500 x 260-440 px (gradients + noise + ellipses, ~75 KB each, like
    ImageNet's files) in 10 classes; 90% train/, 10% val/ (from the ingest notes' generator)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    for i in range(n):
        c = i % 10
        w, h = int(rng.integers(300, 500)), int(rng.integers(260, 440))
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([(xx * (c + 1) / w * 255) % 256, (yy * 3 / h * 255) % 256,
                         (xx + yy) / (w + h) * 255], -1)
        img = (base + rng.normal(0, 25, base.shape)).clip(0, 255).astype(np.uint8)
        im = Image.fromarray(img)
        d = ImageDraw.Draw(im)
        for _ in range(5):
            x0, y0 = int(rng.integers(0, w - 50)), int(rng.integers(0, h - 50))
            d.ellipse([x0, y0, x0 + int(rng.integers(20, 120)), y0 + int(rng.integers(20, 120))],
                      fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        split = "val" if i % 10 == 9 and i // 10 % 10 == 0 else "train"
        folder = os.path.join(root, split, f"class{c}")
        os.makedirs(folder, exist_ok=True)
        im.save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)
    for c in range(10):  # every class in val
        os.makedirs(os.path.join(root, "val", f"class{c}"), exist_ok=True)
        src = os.path.join(root, "train", f"class{c}")
        if not os.listdir(os.path.join(root, "val", f"class{c}")):
            f = sorted(os.listdir(src))[0]
            os.rename(os.path.join(src, f), os.path.join(root, "val", f"class{c}", f))


def single_core(files: list[str], size: int, draft: bool) -> float:
    rng = np.random.default_rng(0)
    datas = [open(f, "rb").read() for f in files]
    for d in datas[:20]:  # warm-up: the first calls of a process ran at half speed
        decode_crop(d, size, True, rng, draft=draft)
    t = time.perf_counter()
    for d in datas:
        decode_crop(d, size, True, rng, draft=draft)
    return len(datas) / (time.perf_counter() - t)


def dataloader(root: str, size: int, workers: int, batch: int, epochs: int):
    import torch
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    tf = T.Compose([T.RandomResizedCrop(size), T.PILToTensor()])
    t0 = time.perf_counter()
    ds = ImageFolder(os.path.join(root, "train"), transform=tf)
    dl = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                    persistent_workers=True, drop_last=True)
    first, rate, warm = None, 0.0, None
    for _ in range(epochs):
        t, n, warm = time.perf_counter(), 0, None
        for x, _ in dl:
            first = first or time.perf_counter() - t0
            warm = warm or time.perf_counter() - t
            n += len(x)
        rate = n / (time.perf_counter() - t)
    del dl
    torch.set_num_threads(torch.get_num_threads())
    return rate, first, warm


def torchrun_worker(root: str, size: int, batch: int, epochs: int, model_name: str,
                    loaders: int) -> None:
    """One rank of the hand-written baseline (run under ``torchrun --nproc_per_node 2``):
    ImageFolder + DistributedSampler + DataLoader with torchvision's RandomResizedCrop/flip/
    ToTensor/Normalize, DDP on gloo, SGD; rank 0 prints a JSON line."""
    import json

    import torch
    import torch.distributed as dist
    import torchvision.transforms as T
    from torch.utils.data import DataLoader, DistributedSampler
    from torchvision.datasets import ImageFolder

    from raytrain.models import build_model

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    ds = ImageFolder(os.path.join(root, "train"), transform=tf)
    sampler = DistributedSampler(ds, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=loaders,
                    persistent_workers=loaders > 0, drop_last=True)
    model = torch.nn.parallel.DistributedDataParallel(
        build_model(model_name, len(ds.classes), image_size=size))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    first, rate = None, 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        t, n = time.perf_counter(), 0
        for x, y in dl:
            first = first or time.perf_counter() - t0
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += len(y)
        rate = n * dist.get_world_size() / (time.perf_counter() - t)
    if dist.get_rank() == 0:
        print(json.dumps({"images_per_s": rate, "first_batch_s": first}), flush=True)
    dist.destroy_process_group()


def with_step(root: str, size: int, batch: int, epochs: int, model: str, loaders: int):
    """Input + training step, 2 processes each side: (torchrun rate, first batch), (raytrain
    rate, first batch). Global images/s of the last epoch."""
    import json
    import subprocess

    here = os.path.abspath(__file__)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(here)),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
         "--nproc_per_node", "2", here, "--torchrun-worker", root, str(size), str(batch),
         str(epochs), model, str(loaders)], capture_output=True, text=True, env=env,
        check=True).stdout
    base = json.loads(out.strip().splitlines()[-1])
    runs = tempfile.mkdtemp(prefix="raytrain-ingest-runs-")
    subprocess.run([sys.executable, "-m", "raytrain.fit", "--dataset", "imagefolder",
                    "--data-dir", root, "--image-size", str(size), "--model", model,
                    "--num-workers", "2", "--batch-size", str(2 * batch), "--epochs",
                    str(epochs), "--lr-schedule", "constant", "--lr", "0.01",
                    "--storage-path", runs, "--name", "step", "--progress-every", "0"],
                   capture_output=True, text=True, env=env, check=True)
    with open(os.path.join(runs, "step", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return ((base["images_per_s"], base["first_batch_s"]),
            (rows[-1]["images_per_s"], rows[0]["first_batch_s"]))


def raydata(root: str, size: int, batch: int, epochs: int, on_worker: bool):
    t0 = time.perf_counter()
    datasets, _, _ = build_datasets("imagefolder", root, size, seed=0,
                                              decode_on_worker=on_worker)
    it = datasets["train"].iterator()
    spec = {"size": size, "train": True, "seed": 0} if on_worker else None
    first, rate, warm = None, 0.0, None
    for _ in range(epochs):
        t, n, warm = time.perf_counter(), 0, None
        for x, _, _ in iter_batches(it, batch, "cpu", train=True, decode=spec):
            first = first or time.perf_counter() - t0
            warm = warm or time.perf_counter() - t
            n += len(x)
        rate = n / (time.perf_counter() - t)
    return rate, first, warm


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="96 images, crop 32, 1 epoch each")
    p.add_argument("--images", type=int, default=1500)
    p.add_argument("--sizes", default="64,224")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--data", default=None, help="reuse/generate the folder here")
    p.add_argument("--step-model", default="small-cnn",
                   help="input + step rows: the model both sides train ('' = skip them)")
    p.add_argument("--step-size", type=int, default=64, help="input + step rows: the crop")
    p.add_argument("--loader-workers", type=int, default=2,
                   help="the torchrun side's DataLoader processes per rank")
    p.add_argument("--torchrun-worker", nargs=6, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.torchrun_worker:
        root, size, batch, epochs, model, loaders = a.torchrun_worker
        return torchrun_worker(root, int(size), int(batch), int(epochs), model, int(loaders))
    if a.quick:
        a.images, a.sizes, a.epochs, a.batch = 96, "32", 1, 16
        a.step_model = ""  # the step rows start a Ray cluster and torchrun: minutes
    sizes = [int(s) for s in a.sizes.split(",")]
    root = a.data or tempfile.mkdtemp(prefix="raytrain-ingest-")
    if not os.path.isdir(os.path.join(root, "train")):
        t = time.perf_counter()
        generate(root, a.images)
        print(f"generated {a.images} JPEGs in {root} ({time.perf_counter() - t:.0f} s)")
    listing = list_image_folder(root)
    n_train = listing.counts["train"]
    mb = sum(np.asarray(listing.tables["train"].column("size"))) / 2**20
    files = listing.tables["train"].column("path").to_pylist()[:min(200, n_train)]
    results: dict[str, dict[int, str]] = {}

    rates: dict[tuple[str, int], float] = {}

    def put(name, size, rate, first=None, warm=None):
        rates[name, size] = rate
        results.setdefault(name, {})[size] = f"{rate:6.0f}" + (
            f" / {first:4.2f} / {warm:4.2f}" if first else "")

    for s in sizes:
        put("single core PIL decode+RRC", s, single_core(files, s, draft=False))
        put("single core PIL + draft()", s, single_core(files, s, draft=True))
        for w in (1, 2, 3):
            put(f"ImageFolder+DataLoader, {w} worker(s)", s, *dataloader(root, s, w, a.batch,
                                                                          a.epochs))
    import ray
    from ray.data import DataContext

    ray.init(address="local", num_cpus=2, logging_level="ERROR", include_dashboard=False)
    DataContext.get_current().enable_progress_bars = False
    try:
        for s in sizes:
            put("raytrain Ray Data (decode in tasks)", s, *raydata(root, s, a.batch, a.epochs,
                                                                   False))
            put("raytrain bytes -> worker decode_jpeg", s, *raydata(root, s, a.batch, a.epochs,
                                                                    True))
    finally:
        ray.shutdown()
    if a.step_model:
        (b_rate, b_first), (r_rate, r_first) = with_step(root, a.step_size, a.batch, a.epochs,
                                                         a.step_model, a.loader_workers)
        print(f"\ninput + step, --model {a.step_model}, crop {a.step_size}, 2 processes, "
              f"{a.batch} per process, last of {a.epochs} epochs (global images/s; first batch "
              "from process start)")
        print(f"torchrun + ImageFolder/DataLoader ({a.loader_workers} loaders per rank): "
              f"{b_rate:7.0f} images/s, first batch {b_first:5.1f}s")
        print(f"raytrain.fit --dataset imagefolder:                {r_rate:7.0f} images/s, "
              f"first batch {r_first:5.1f}s into its first epoch; ratio {r_rate / b_rate:.2f}x")
    load = os.getloadavg()[0]
    print(f"\n{n_train} train JPEGs ({mb:.0f} MB), batch {a.batch}, {a.epochs} epoch(s), "
          f"{os.cpu_count()} cores, load avg {load:.1f} at the end; images/s (last epoch) / "
          f"first batch cold / warm, seconds")
    head = f"{'pipeline':40s}" + "".join(f" | crop {s:<18d}" for s in sizes)
    print(head + "\n" + "-" * len(head))
    for name, row in results.items():
        print(f"{name:40s}" + "".join(f" | {row.get(s, ''):23s}" for s in sizes))
    ray_row = "raytrain Ray Data (decode in tasks)"
    for s in sizes:
        best = max((w for w in (1, 2, 3)), key=lambda w: rates[
            f"ImageFolder+DataLoader, {w} worker(s)", s])
        dl = rates[f"ImageFolder+DataLoader, {best} worker(s)", s]
        limit = max(rates["single core PIL decode+RRC", s], rates["single core PIL + draft()", s])
        print(f"crop {s}: Ray Data / best DataLoader ({best} workers) = "
              f"{rates[ray_row, s] / dl:.2f}x; Ray Data per core = "
              f"{rates[ray_row, s] / 2:.0f} images/s = {rates[ray_row, s] / 2 / limit:.0%} of "
              f"the single-core limit ({limit:.0f})")


if __name__ == "__main__":
    main()
