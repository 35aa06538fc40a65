"""ResNet-18 (CIFAR stem) training throughput on one device, and model FLOP utilisation (MFU).

    python benchmarks/gpu_throughput.py                        # 1 GPU: bf16, channels_last
    python benchmarks/gpu_throughput.py --batch-size 1024 --sweep 256 512 1024 2048
    python benchmarks/gpu_throughput.py --device cpu --quick   # smoke test (fp32, tiny)

No Ray: raytrain's own per-worker code runs in this process (world size 1, so no DDP).
Measured, images/s (CUDA timings bracketed by torch.cuda.synchronize):
  1. raytrain loop: ``raytrain.worker.loop.run_worker`` on ``--dataset synthetic`` (CIFAR-shaped uint8,
     --images per epoch, augmentation on), ``--model resnet18``, per-device batch --batch-size,
     precision bf16 on CUDA (fp32 on CPU), channels_last (what run_worker does); the
     figure is the reported per-epoch ``images_per_s`` (training only) over epochs 2..N.
  2. step + data: a bare timed loop over ``raytrain.worker.loop.train_step`` fed exactly like
     train_epoch feeds it (uint8 images on the device, epoch_shard/batches indices,
     ``raytrain.data.Augment`` crop+flip+normalise, channels_last), without train_epoch's
     per-step bookkeeping (metric sums, NaN tracking).
  3. step alone: train_step on one fixed, already-augmented batch (no data work).
  4. data alone: Augment on index batches (no model).
  (3) vs (2) shows whether the device waits on data; (1) vs (2) is what train_epoch's
  per-step bookkeeping costs. --sweep adds (3) at other batch sizes; --compile adds (2) and (3)
  with ``torch.compile(model)``.
MFU = images/s x FLOPs per image / peak FLOP/s. FLOPs of one forward+backward step are counted
with ``torch.utils.flop_counter.FlopCounterMode`` (convs and matmuls; the optimizer's
element-wise work is not counted) and divided by the batch size. --peak-tflops defaults to
989 (H100/H200 SXM dense bf16) on CUDA and to none (MFU not shown) on CPU; give the peak for the
precision you run. Target (issue #7): >= 50,000 images/s bf16 on one H200.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from raytrain.worker import loop
from raytrain.config import TrainConfig
from raytrain.data import Augment, batches, epoch_shard, load_dataset, steps_per_epoch
from raytrain.models import build_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=512, help="per-device batch")
    p.add_argument("--images", type=int, default=50_000, help="training images per epoch (1.)")
    p.add_argument("--epochs", type=int, default=5, help="run_worker epochs (1.); first = warm-up")
    p.add_argument("--steps", type=int, default=200, help="timed steps (2.-4.)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before (2.-4.)")
    p.add_argument("--precision", choices=("bf16", "fp32", "fp16"), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak TFLOP/s for the precision (default 989 on CUDA)")
    p.add_argument("--sweep", type=int, nargs="*", default=[],
                   help="also time 'step alone' at these batch sizes")
    p.add_argument("--compile", action="store_true", help="also time with torch.compile")
    p.add_argument("--skip-run-worker", action="store_true", help="skip measurement 1")
    p.add_argument("--quick", action="store_true",
                   help="tiny: 64 images, batch 16, 2 epochs, 2+1 steps (a smoke test)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.quick:
        args.images, args.batch_size, args.epochs, args.steps, args.warmup = 64, 16, 2, 2, 1
        args.sweep = args.sweep[:1]
    if args.precision is None:
        args.precision = "bf16" if args.device.type == "cuda" else "fp32"
    if args.peak_tflops is None and args.device.type == "cuda":
        args.peak_tflops = 989.0
        name = torch.cuda.get_device_name(args.device)
        if not any(g in name for g in ("H100", "H200")):
            print(f"note: {name} is not an H100/H200; MFU uses 989 TFLOP/s unless you pass "
                  "--peak-tflops", flush=True)
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def config(args, batch: int) -> TrainConfig:
    return TrainConfig.from_flat(dict(
        num_workers=1, model="resnet18", dataset="synthetic", synthetic_size=args.images,
        augment=True, batch_size=batch, epochs=args.epochs, precision=args.precision,
        # run_worker writes nothing under storage_path unless the run directory exists
        storage_path=os.path.join(tempfile.gettempdir(), "raytrain-gpu-bench-unused"),
        name="bench",
        checkpoint_every=10**6))


class Setup:
    """Model, optimizer, data and Augment built the way run_worker builds them."""

    def __init__(self, args, batch: int, compiled: bool = False):
        dev = args.device
        self.cfg = cfg = config(args, batch)
        torch.manual_seed(0)
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = True
        self.data = load_dataset("synthetic", synthetic_size=max(args.images, batch)).to(dev)
        self.worker = loop.Worker(0, 0, 1, dev)
        self.model = loop.prepare_model(build_model("resnet18", 10), self.worker)
        self.step_model = torch.compile(self.model) if compiled else self.model
        self.optimizer = loop.make_optimizer(self.model, cfg)
        self.amp = loop.autocast_dtype(cfg.optim.precision, dev)
        self.scaler = torch.amp.GradScaler(dev.type, enabled=self.amp == torch.float16)
        self.aug = Augment(self.data.mean, self.data.std, dev, crop_pad=4, flip=True,
                           channels_last=True)
        self.gen = torch.Generator(device=dev).manual_seed(0)
        self.batch = batch

    def index_batches(self):
        """Endless per-epoch index batches, as train_epoch makes them."""
        n, epoch = len(self.data.train_y), 0
        steps = steps_per_epoch(n, 1, self.batch)
        while True:
            epoch += 1
            yield from batches(epoch_shard(n, 0, 1, 0, epoch).to(self.data.train_x.device), steps)

    def step(self, x, y):
        return loop.train_step(self.step_model, x, y, self.optimizer, self.scaler, self.amp,
                               False)


def timed(fn, device, warmup: int, steps: int, batch: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return steps * batch / (time.perf_counter() - t0)


def flops_per_image(s: Setup) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    x = s.aug(s.data.train_x[:s.batch], s.gen)
    y = s.data.train_y[:s.batch]
    counter = FlopCounterMode(display=False)
    with counter:
        with torch.autocast(x.device.type, dtype=s.amp or torch.float32, enabled=s.amp is not None):
            loss = torch.nn.functional.cross_entropy(s.model(x).float(), y)
        loss.backward()
    s.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops() / s.batch


def measure_direct(args, batch: int, compiled: bool = False) -> dict[str, float]:
    s = Setup(args, batch, compiled)
    idx = s.index_batches()

    def step_and_data():
        i = next(idx)
        s.step(s.aug(s.data.train_x[i], s.gen), s.data.train_y[i])

    x_fixed = s.aug(s.data.train_x[:batch], s.gen)
    y_fixed = s.data.train_y[:batch]

    def step_alone():
        s.step(x_fixed, y_fixed)

    def data_alone():
        i = next(idx)
        s.aug(s.data.train_x[i], s.gen)

    out = {"step_alone": timed(step_alone, args.device, args.warmup, args.steps, batch)}
    out["step_and_data"] = timed(step_and_data, args.device, args.warmup, args.steps, batch)
    if not compiled:
        out["data_alone"] = timed(data_alone, args.device, args.warmup, args.steps, batch)
        out["flops_per_image"] = flops_per_image(s)
    return out


def measure_run_worker(args) -> dict:
    cfg = config(args, args.batch_size)
    rows = []
    t0 = time.perf_counter()
    loop.run_worker(cfg, loop.Worker(0, 0, 1, args.device), lambda m, state: rows.append(m))
    wall = time.perf_counter() - t0
    steady = [r for r in rows if r["epoch"] >= 2] or rows
    n = sum(r.get("train_count", r["images_per_s"] * r["epoch_s"]) for r in steady)
    return {"images_per_s": n / sum(r["epoch_s"] for r in steady),
            "epoch_images_per_s": [round(r["images_per_s"], 1) for r in rows],
            "wall_s": wall, "test_acc": rows[-1]["test_acc"] if rows else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = args.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"gpu_throughput: resnet18 (CIFAR stem) on {name}, {args.precision}, batch "
          f"{args.batch_size}, torch {torch.__version__}, peak "
          f"{args.peak_tflops or 'n/a'} TFLOP/s", flush=True)
    direct = measure_direct(args, args.batch_size)
    fpi = direct.pop("flops_per_image")
    print(f"FLOPs per image (fwd+bwd, FlopCounterMode): {fpi / 1e9:.3f} GFLOP", flush=True)
    rows = [("step alone (fixed batch, no data)", args.batch_size, direct["step_alone"]),
            ("step + data (train_step + Augment)", args.batch_size, direct["step_and_data"]),
            ("data alone (Augment only)", args.batch_size, direct["data_alone"])]
    for b in args.sweep:
        if b != args.batch_size:
            rows.append((f"step alone, batch {b}", b, measure_direct(args, b)["step_alone"]))
    compiled = None
    if args.compile:
        compiled = measure_direct(args, args.batch_size, compiled=True)
        rows += [("step alone, torch.compile", args.batch_size, compiled["step_alone"]),
                 ("step + data, torch.compile", args.batch_size, compiled["step_and_data"])]
    worker = None
    if not args.skip_run_worker:
        worker = measure_run_worker(args)
        rows.insert(0, (f"raytrain loop (run_worker, epochs 2..{args.epochs})",
                        args.batch_size, worker["images_per_s"]))

    def mfu(ips: float) -> str:
        if not args.peak_tflops:
            return "n/a"
        return f"{100 * ips * fpi / (args.peak_tflops * 1e12):.1f}%"

    print(f"\n{'measurement':<44}{'batch':>7}{'images/s':>12}{'TFLOP/s':>10}{'MFU':>8}")
    for label, b, ips in rows:
        tflops = ips * fpi / 1e12 if "data alone" not in label else None
        print(f"{label:<44}{b:>7}{ips:>12,.0f}{fmt(tflops, '.1f'):>10}"
              f"{mfu(ips) if tflops is not None else '':>8}")
    wait = 1 - direct["step_and_data"] / direct["step_alone"]
    print(f"\ndata loading costs {100 * wait:.1f}% of step throughput "
          f"(step+data / step alone = {direct['step_and_data'] / direct['step_alone']:.2f}x)")
    if worker:
        print(f"raytrain loop / bare step+data = "
              f"{worker['images_per_s'] / direct['step_and_data']:.2f}x "
              f"(per-epoch: {worker['epoch_images_per_s']})")
        print(f"target >= 50,000 images/s (bf16, one H200): raytrain loop "
              f"{worker['images_per_s']:,.0f} images/s = "
              f"{worker['images_per_s'] / 50_000:.2f}x target")
    print(json.dumps({
        "benchmark": "gpu_throughput", "device": name, "precision": args.precision,
        "batch": args.batch_size, "peak_tflops": args.peak_tflops, "flops_per_image": fpi,
        "images_per_s": {label: ips for label, _, ips in rows},
        "mfu": {label: (ips * fpi / (args.peak_tflops * 1e12) if args.peak_tflops else None)
                for label, _, ips in rows if "data alone" not in label},
        "run_worker": worker, "torch": torch.__version__}))
    return 0


def fmt(v, spec: str) -> str:
    return format(v, spec) if v is not None else ""


if __name__ == "__main__":
    sys.exit(main())
