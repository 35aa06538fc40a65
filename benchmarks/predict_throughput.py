"""Batch prediction throughput: ``python -m raytrain.predict`` (Ray Data decode tasks -> an
actor pool holding the model) vs a plain torch loop (torchvision ImageFolder + DataLoader with
the best of several num_workers, the model in the main process), same model, crop, batch and
weights, on one generated folder of photo-like JPEGs (benchmarks/folder_ingest.py's).

    python benchmarks/predict_throughput.py --quick             # smoke: 64 images, lenet, 32 px
    python benchmarks/predict_throughput.py --images 2000 --model resnet18 --size 112
    python benchmarks/predict_throughput.py --device cuda --model resnet50 --size 224 \\
        --images 20000 --batch 256                               # on a GPU node

Both sides: the eval transform (short side to size*256/224, centre crop), ImageNet
normalisation, inference_mode; on CUDA bf16 autocast + channels_last. images/s = images /
wall seconds of one pass, from building the loader (DataLoader: its workers' fork; predict:
listing, actor start, model load; the Ray cluster is started before and not counted) to the
last row. "per core" divides by the machine's cores; the single-core row is PIL decode + crop
in this process (draft mode, as predict decodes): the per-core decode limit.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from folder_ingest import generate  # noqa: E402

from raytrain.data.decode import EVAL_RESIZE, decode_crop  # noqa: E402
from raytrain.data.sources import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402


def single_core(files: list[str], size: int) -> float:
    datas = [open(f, "rb").read() for f in files]
    for d in datas[:10]:  # warm-up
        decode_crop(d, size, False, None)
    t = time.perf_counter()
    for d in datas:
        decode_crop(d, size, False, None)
    return len(datas) / (time.perf_counter() - t)


def plain_loop(root: str, weights: str, model_name: str, size: int, batch: int, workers: int,
               device: str) -> tuple[float, int]:
    """(images/s, images) of the hand-written loop: ImageFolder + DataLoader -> model."""
    import torch
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    from raytrain.models import build_model

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    model = build_model(model_name, 10, image_size=size)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model = model.eval().to(dev)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    tf = T.Compose([T.Resize(int(size * EVAL_RESIZE)), T.CenterCrop(size),
                    T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    t0 = time.perf_counter()
    ds = ImageFolder(root, transform=tf)
    dl = DataLoader(ds, batch_size=batch, num_workers=workers, pin_memory=cuda)
    n = 0
    with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
        for x, _ in dl:
            x = x.to(dev, non_blocking=True)
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            probs = torch.softmax(model(x).float(), 1)
            probs.max(1)[0].cpu()  # the rows: on the host, as predict writes them
            n += len(x)
    return n / (time.perf_counter() - t0), n


def raytrain_predict(root: str, weights: str, model_name: str, size: int, batch: int,
                     workers: int, device: str) -> tuple[float, int]:
    """(images/s, rows written) of ``raytrain.predict.main`` on the running Ray cluster."""
    import pyarrow.parquet as pq

    from raytrain import predict

    out = os.path.join(tempfile.mkdtemp(prefix="raytrain-predict-bench-"), "preds.parquet")
    argv = [weights, "--model", model_name, "--image-size", str(size), "--data-dir", root,
            "--out", out, "--batch-size", str(batch), "--num-workers", str(workers),
            "--progress-every", "0"] + (["--use-gpu"] if device == "cuda" else [])
    said = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(said):
        rc = predict.main(argv)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"raytrain.predict failed (exit {rc}): {said.getvalue()[-500:]}")
    rows = pq.read_metadata(out).num_rows
    return rows / wall, rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64 images, lenet at 32 px")
    p.add_argument("--images", type=int, default=1500)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=112, help="crop side in pixels")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--loader-workers", default=None,
                   help="DataLoader num_workers to try, comma-separated (default 1..cores)")
    p.add_argument("--predict-workers", default="1,2",
                   help="raytrain.predict --num-workers to try, comma-separated (on CPU they "
                   "share the CPUs the decode tasks leave)")
    p.add_argument("--data", default=None, help="reuse/generate the folder here")
    a = p.parse_args(argv)
    if a.quick:
        a.images, a.model, a.size, a.batch, a.loader_workers = 64, "lenet", 32, 16, "1"
        a.predict_workers = "1"
    cores = os.cpu_count() or 1
    tries = ([int(w) for w in a.loader_workers.split(",")] if a.loader_workers
             else list(range(1, cores + 1)))
    root = a.data or tempfile.mkdtemp(prefix="raytrain-predict-photos-")
    if not os.path.isdir(os.path.join(root, "train")):
        t = time.perf_counter()
        generate(root, a.images)
        print(f"generated {a.images} JPEGs in {root} ({time.perf_counter() - t:.0f} s)")
    import torch

    from raytrain.models import build_model

    weights = os.path.join(root, f"{a.model}.pt")
    torch.manual_seed(0)
    torch.save(build_model(a.model, 10, image_size=a.size).state_dict(), weights)
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".jpg")]
    rows = {"single core PIL decode + eval crop (draft)": single_core(files[:200], a.size)}
    best, n_plain = 0.0, 0
    for w in tries:
        rate, n_plain = plain_loop(root, weights, a.model, a.size, a.batch, w, a.device)
        rows[f"ImageFolder + DataLoader, {w} worker(s)"] = rate
        best = max(best, rate)
    import ray

    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    ray.init(address="local", num_cpus=cores, num_gpus=gpus, logging_level="ERROR",
             include_dashboard=False)
    rate = 0.0
    try:
        for w in [int(w) for w in a.predict_workers.split(",")]:
            r, n_pred = raytrain_predict(root, weights, a.model, a.size, a.batch, w, a.device)
            rows[f"raytrain.predict, {w} worker(s)"] = r
            rate = max(rate, r)
            assert n_pred == n_plain, (n_pred, n_plain)  # the same images, every one labelled
    finally:
        ray.shutdown()
    print(f"\n{n_plain} images, {a.model} at {a.size} px, batch {a.batch}, {a.device}, "
          f"{cores} cores (images/s over one pass; per core in brackets)")
    for name, r in rows.items():
        print(f"  {name:<48} {r:8.0f}  ({r / (1 if name.startswith('single') else cores):6.0f})")
    print(f"  best raytrain.predict / best DataLoader: {rate / best:.2f}x")
    print(json.dumps({"images": n_plain, "model": a.model, "size": a.size, "device": a.device,
                      "cores": cores, "predict_images_per_s": round(rate, 1),
                      "dataloader_best_images_per_s": round(best, 1),
                      "single_core_decode_images_per_s": round(rows[next(iter(rows))], 1),
                      "ratio": round(rate / best, 3)}))


if __name__ == "__main__":
    main()
