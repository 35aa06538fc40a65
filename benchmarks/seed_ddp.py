"""The seed's hand-written DDP recipe, as users write it, fixed so it runs: the baseline.

    torchrun --standalone --nproc_per_node 2 benchmarks/seed_ddp.py            # 3 x 6,400 images
    torchrun --standalone --nproc_per_node 2 benchmarks/seed_ddp.py --quick    # smoke test
    python benchmarks/seed_ddp.py --quick      # no torchrun: re-launches itself under torchrun

What it is: the seed script's shape, kept deliberately plain (no raytrain import). torchrun
starts one process per worker; each joins a process group (gloo on CPU, nccl with CUDA), wraps
the seed CNN (conv(3,6,5)-pool-conv(6,16,5)-pool-fc120-fc84-fc10) in DDP and trains it with
SGD(lr 0.001, momentum 0.9), batch 64 *per worker*, a ``DistributedSampler`` with
``set_epoch(epoch)``, ``DataLoader(num_workers=0)``, ``loss.item()`` every step for the running
loss and a log line every 100 batches on rank 0; rank 0 prints the test accuracy at the end.
What the seed got wrong and is fixed here: ``rank``/``device`` were undefined (now read from
torchrun's LOCAL_RANK/RANK/WORLD_SIZE), nccl was hard-coded (gloo when there is no GPU).

Data (no download possible): CIFAR-shaped synthetic images drawn exactly as raytrain's
``--dataset synthetic`` draws them (uint8, generator seeded 1234, test split = train/5), so both
sides see the same pixels and labels. ``--data float`` (default) converts them once, up front,
to normalised float32 (``x/255``, Normalize(0.5, 0.5)) in a ``TensorDataset``: the tutorial's
``ToTensor() + Normalize`` paid before training, as when a user caches tensors.
``--data uint8`` keeps the ``TensorDataset`` uint8 and does the same conversion per batch after
the loader (ToTensor-style work inside the timed loop).

What is measured: per epoch, the wall time of the training loop alone (from iterating the
loader to the last optimizer step; evaluation excluded, as in raytrain's ``images_per_s``) and
the images this worker trained -> images/s per worker. Steady state = epochs after the first
``--warmup-epochs`` (default 1): total images / total seconds over those epochs, per worker;
the headline is the mean over workers. Threads per process are torchrun's default
(OMP_NUM_THREADS=1 for nproc > 1), the same as a 1-CPU Ray worker. The last stdout line is
one JSON object (``"benchmark": "seed_ddp"``), which launcher_overhead.py parses; it holds
``first_step_at`` (epoch seconds after rank 0's first optimizer step) for time-to-first-step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    """The seed CNN (copied, like the user's script has it)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(n_train: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 [N,3,32,32] images and labels, drawn like raytrain.data._synthetic (same seed)."""
    g = torch.Generator().manual_seed(1234)
    n_test = max(n_train // 5, 1)
    x = torch.randint(0, 256, (n_train + n_test, 3, 32, 32), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (n_train + n_test,), generator=g)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def to_float(x: torch.Tensor) -> torch.Tensor:
    """ToTensor() + Normalize((0.5,)*3, (0.5,)*3) on a uint8 batch."""
    return (x.float() / 255 - 0.5) / 0.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-size", type=int, default=6400, help="synthetic training images")
    p.add_argument("--batch-size", type=int, default=64, help="PER-WORKER batch")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--data", choices=("float", "uint8"), default="float")
    p.add_argument("--warmup-epochs", type=int, default=1,
                   help="epochs left out of the steady-state figure")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--nproc", type=int, default=2,
                   help="workers when not started by torchrun (re-launches under torchrun)")
    p.add_argument("--quick", action="store_true", help="2 epochs of 1,280 images")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.train_size = 2, 1280
    return args


def relaunch_under_torchrun(args) -> int:
    """`python benchmarks/seed_ddp.py` without torchrun: run the same argv under torchrun."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [exe] if os.path.exists(exe) else [shutil.which("torchrun") or "torchrun"]
    cmd += ["--standalone", f"--nproc_per_node={args.nproc}", os.path.abspath(__file__)]
    import subprocess

    return subprocess.call(cmd + sys.argv[1:])


def main(argv=None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        return relaunch_under_torchrun(args)
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    train_x, train_y, test_x, test_y = synthetic_cifar(args.train_size)
    if args.data == "float":
        train_x, test_x = to_float(train_x), to_float(test_x)
    trainset = TensorDataset(train_x, train_y)
    sampler = DistributedSampler(trainset)
    trainloader = DataLoader(trainset, batch_size=args.batch_size, sampler=sampler,
                             num_workers=0)

    net = Net().to(device)
    ddp_net = DDP(net, device_ids=[local_rank] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(ddp_net.parameters(), lr=args.lr, momentum=0.9)

    per_epoch = []  # (images, seconds) of this worker
    first_step_at = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        running_loss, images = 0.0, 0
        start = time.perf_counter()
        for i, (inputs, labels) in enumerate(trainloader):
            inputs, labels = inputs.to(device), labels.to(device)
            if args.data == "uint8":
                inputs = to_float(inputs)
            optimizer.zero_grad()
            outputs = ddp_net(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            images += len(labels)
            if first_step_at is None:
                first_step_at = time.time()
            if args.log_every and i % args.log_every == args.log_every - 1:
                if rank == 0:
                    print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / args.log_every:.3f}",
                          flush=True)
                running_loss = 0.0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        per_epoch.append((images, seconds))
        if rank == 0:
            print(f"epoch {epoch + 1}: {images / seconds:,.0f} images/s on rank 0 "
                  f"({images} images, {seconds:.2f}s)", flush=True)

    steady = per_epoch[args.warmup_epochs:] or per_epoch  # too few epochs: all of them
    mine = sum(n for n, _ in steady) / sum(s for _, s in steady)
    everyone = [None] * world
    dist.all_gather_object(everyone, {"steady": mine, "epochs": [n / s for n, s in per_epoch]})

    test_acc = None
    if rank == 0:  # the tutorial's "accuracy of the network on the test images"
        correct = 0
        net.eval()
        with torch.no_grad():
            for i in range(0, len(test_y), 1000):
                x = test_x[i:i + 1000]
                x = (x if args.data == "float" else to_float(x)).to(device)
                correct += (net(x).argmax(1).cpu() == test_y[i:i + 1000]).sum().item()
        test_acc = correct / len(test_y)
        print(f"Accuracy of the network on the {len(test_y)} test images: {100 * test_acc:.1f} %")
    dist.barrier()
    if rank == 0:
        result = {
            "benchmark": "seed_ddp", "world": world, "backend": backend,
            "device": str(device), "threads_per_worker": torch.get_num_threads(),
            "per_worker_batch": args.batch_size, "epochs": args.epochs,
            "train_size": args.train_size, "data": args.data,
            "warmup_epochs": args.warmup_epochs if len(per_epoch) > args.warmup_epochs else 0,
            "images_per_s_per_worker": sum(e["steady"] for e in everyone) / world,
            "steady_images_per_s_by_rank": [round(e["steady"], 1) for e in everyone],
            "epoch_images_per_s_by_rank": [[round(v, 1) for v in e["epochs"]]
                                           for e in everyone],
            "first_step_at": first_step_at, "test_acc": test_acc,
        }
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
