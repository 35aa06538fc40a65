"""Input pipeline: the seed's PIL + torchvision transforms + DataLoader vs raytrain's batched
tensor augmentation, alone and with a training step, at equal model (seed CNN) and batch (64).

    python benchmarks/data_path.py            # 10,000 images, 3 epochs (1 warm-up), 3 rounds
    python benchmarks/data_path.py --quick    # smoke test
    python benchmarks/data_path.py --threads 2 --loader-workers 0 2 4

Seed pipeline (as the seed script has it): a torchvision ``CIFAR10`` object (its own
``__getitem__``: ``Image.fromarray`` on an HWC uint8 array, then the transform) whose ``data``/
``targets`` are set directly (no download possible), transform ``Compose([RandomCrop(32,
padding=4), RandomHorizontalFlip(), ToTensor(), Normalize(CIFAR mean, std)])``,
``DataLoader(batch_size=64, shuffle=True, num_workers=W)`` for each W in --loader-workers
(default 0 and 2; worker processes re-forked every epoch, as without persistent_workers).
raytrain pipeline: the same images as one uint8 [N,3,32,32] tensor, indices from
``raytrain.data.epoch_shard`` + ``batches``, ``raytrain.data.Augment(crop_pad=4, flip=True)``
(normalise + random crop + flip as batched tensor ops) on the CPU. Images: CIFAR-shaped
synthetic uint8 from ``raytrain.data.load_dataset("synthetic")`` (fixed seed), the same pixels
for both.

Measured, images/s: (1) the input pipeline alone (batches produced, nothing else), (2) input +
train step (the same plain step on both sides: zero_grad, seed CNN forward, cross-entropy,
backward, SGD lr 0.001 momentum 0.9 step), and for reference (3) the train step alone on one
fixed batch (the ceiling). Each configuration runs --epochs epochs; the first --warmup-epochs
are left out; figure = images / seconds over the rest (an epoch's time includes creating the
loader iterator, i.e. worker start-up for W > 0). --rounds rounds cycle through all
configurations (order rotated each round); the median over rounds is reported. The main process
uses --threads intra-op threads (default 1: one CPU per worker, as a 1-CPU Ray worker or a
torchrun process gets); loader workers are extra processes on top. Ratios are raytrain / seed.
Target (issue #7): raytrain's data path >= 1.3x the seed DataLoader on CPU. The last stdout line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from raytrain.data import Augment, batches, epoch_shard, load_dataset, steps_per_epoch
from raytrain.models import SeedCNN

BATCH = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=10_000, help="training images per epoch")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (main process)")
    p.add_argument("--loader-workers", type=int, nargs="+", default=[0, 2],
                   help="DataLoader num_workers values for the seed pipeline")
    p.add_argument("--quick", action="store_true", help="1,280 images, 2 epochs, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.epochs, args.rounds = 1280, 2, 1
    args.warmup_epochs = min(args.warmup_epochs, args.epochs - 1)
    return args


# ---------------------------------------------------------------------------- pipelines


def seed_loader(data, workers: int):
    """The seed's input pipeline over ``data``'s training images."""
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.vision import VisionDataset

    transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(data.mean, data.std)])
    trainset = CIFAR10.__new__(CIFAR10)  # torchvision's class and __getitem__, no files
    VisionDataset.__init__(trainset, root="unused", transform=transform)
    trainset.train = True
    trainset.data = data.train_x.permute(0, 2, 3, 1).contiguous().numpy()  # HWC, as on disk
    trainset.targets = data.train_y.tolist()
    return DataLoader(trainset, batch_size=BATCH, shuffle=True, num_workers=workers)


class SeedPipeline:
    def __init__(self, data, workers: int):
        self.loader = seed_loader(data, workers)
        self.name = f"seed DataLoader (num_workers={workers})"

    def epoch(self, epoch: int):
        yield from self.loader


class RaytrainPipeline:
    """What raytrain.worker.loop.train_epoch does for its batches, on the CPU, one worker."""

    name = "raytrain Augment (uint8 tensor)"

    def __init__(self, data, seed: int = 0):
        self.data, self.seed = data, seed
        self.aug = Augment(data.mean, data.std, torch.device("cpu"), crop_pad=4,
                           flip=data.flip_ok, channels_last=False)
        self.steps = steps_per_epoch(len(data.train_y), 1, BATCH)

    def epoch(self, epoch: int):
        shard = epoch_shard(len(self.data.train_y), 0, 1, self.seed, epoch)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        for idx in batches(shard, self.steps):
            yield self.aug(self.data.train_x[idx], gen), self.data.train_y[idx]


def make_step():
    torch.manual_seed(0)
    model = SeedCNN(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)

    def step(x, y):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    return step


# ---------------------------------------------------------------------------- timing


def timed_epochs(pipeline, step, epochs: int, warmup: int) -> float:
    """Images/s over the epochs after ``warmup``; ``step`` None = input pipeline alone."""
    images, seconds = 0, 0.0
    for epoch in range(1, epochs + 1):
        n = 0
        t0 = time.perf_counter()
        for x, y in pipeline.epoch(epoch):
            if step is not None:
                step(x, y)
            n += len(y)
        dt = time.perf_counter() - t0
        if epoch > warmup:
            images, seconds = images + n, seconds + dt
    return images / seconds


def step_alone(data, n_images: int) -> float:
    step = make_step()
    aug = Augment(data.mean, data.std, torch.device("cpu"))
    x, y = aug(data.train_x[:BATCH]), data.train_y[:BATCH]
    for _ in range(5):
        step(x, y)
    steps = max(n_images // BATCH, 10)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    return steps * BATCH / (time.perf_counter() - t0)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_dataset("synthetic", synthetic_size=args.images)
    pipelines = [RaytrainPipeline(data)] + [SeedPipeline(data, w) for w in args.loader_workers]
    names = [p.name for p in pipelines]
    print(f"data_path: {args.images} images x {args.epochs} epochs ({args.warmup_epochs} "
          f"warm-up), batch {BATCH}, seed CNN, {args.threads} thread(s), {args.rounds} round(s)",
          flush=True)
    results = {name: {"input": [], "input+train": []} for name in names}
    results["train step alone"] = {"input+train": []}
    for r in range(args.rounds):
        order = pipelines[r % len(pipelines):] + pipelines[:r % len(pipelines)]
        for p in order:
            for kind in ("input", "input+train"):
                step = make_step() if kind == "input+train" else None
                v = timed_epochs(p, step, args.epochs, args.warmup_epochs)
                results[p.name][kind].append(v)
                print(f"  round {r}: {p.name:<36} {kind:<12} {v:>9,.0f} images/s", flush=True)
        v = step_alone(data, args.images)
        results["train step alone"]["input+train"].append(v)
        print(f"  round {r}: {'train step alone (fixed batch)':<36} {'':<12} {v:>9,.0f} "
              "images/s", flush=True)

    med = {name: {k: statistics.median(v) for k, v in kinds.items()}
           for name, kinds in results.items()}
    ray_name = pipelines[0].name
    print(f"\nmedian images/s over {args.rounds} round(s)")
    print(f"{'pipeline':<38}{'input alone':>14}{'input+train':>14}")
    for name in names:
        print(f"{name:<38}{med[name]['input']:>14,.0f}{med[name]['input+train']:>14,.0f}")
    print(f"{'train step alone (ceiling)':<38}{'':>14}"
          f"{med['train step alone']['input+train']:>14,.0f}")
    ratios = {}
    print(f"\n{'ratio raytrain / seed':<38}{'input alone':>14}{'input+train':>14}"
          f"{'target':>10}")
    for name in names[1:]:
        rr = {k: med[ray_name][k] / med[name][k] for k in ("input", "input+train")}
        ratios[name] = rr
        print(f"{'vs ' + name:<38}{rr['input']:>13.2f}x{rr['input+train']:>13.2f}x"
              f"{'>= 1.3x':>10}")
    print(json.dumps({"benchmark": "data_path", "images": args.images, "epochs": args.epochs,
                      "warmup_epochs": args.warmup_epochs, "rounds": args.rounds,
                      "threads": args.threads, "batch": BATCH, "median_images_per_s": med,
                      "ratios_raytrain_over_seed": ratios, "all": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
