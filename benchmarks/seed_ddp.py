"""The seed's hand-written DDP script under torchrun, fixed only where it cannot run: the baseline.

    torchrun --standalone --nproc_per_node 2 benchmarks/seed_ddp.py            # 3 x 6,400 images
    torchrun --standalone --nproc_per_node 2 benchmarks/seed_ddp.py --quick    # smoke test
    python benchmarks/seed_ddp.py --quick      # no torchrun: re-launches itself under torchrun

What it is: the seed script (../shared/seeds/000_*.txt), kept plain (no raytrain import).
torchrun starts one process per worker; each joins a process group, wraps the seed's ``Net``
(conv 3->32 3x3 pad 1, ReLU, max-pool; conv 32->64 3x3 pad 1, ReLU, max-pool; fc 4096->512,
ReLU; fc 512->10) in DDP and trains it with ``nn.CrossEntropyLoss`` and SGD(lr 0.001, momentum
0.9), batch 64 *per process*, over ``torchvision.datasets.CIFAR10(transform=ToTensor())`` with a
``DistributedSampler`` + ``set_epoch(epoch)`` and ``DataLoader(num_workers=4, pin_memory=True)``,
printing the seed's loss line every 100 batches on every rank (the seed printed on all ranks).
Fixed where it could not run: ``rank``/``size`` were undefined (now torchrun's
LOCAL_RANK/RANK/WORLD_SIZE), ``F`` was never imported, NCCL was hard-coded (gloo without a GPU),
``download=True`` needs the internet (the CIFAR-10 files are written locally, see below),
``pin_memory`` only with CUDA. ``x.view(-1, 64*8*8)`` is kept as the seed wrote it.

Data (no download possible): CIFAR-shaped synthetic images drawn exactly as raytrain's
``--dataset synthetic`` draws them (uint8, generator seeded 1234, test split = train/5), so both
sides see the same pixels and labels, written by rank 0 in CIFAR-10's on-disk format (pickled
``data_batch_*``/``test_batch``) and read back by torchvision's own ``CIFAR10`` class, as the
seed's loader reads the real files: per sample, a PIL image, then ``ToTensor()``.
``--loader-workers`` (default 4, the seed's) sets the DataLoader processes.

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
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Net(nn.Module):
    """The seed's network, as the seed wrote it."""

    def __init__(self, num_classes=10):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = x.view(-1, 64 * 8 * 8)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return x


def synthetic_cifar(n_train: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 [N,3,32,32] images and labels, drawn like raytrain.data._synthetic (same seed)."""
    g = torch.Generator().manual_seed(1234)
    n_test = max(n_train // 5, 1)
    x = torch.randint(0, 256, (n_train + n_test, 3, 32, 32), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (n_train + n_test,), generator=g)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def write_cifar_files(root: str, n_train: int) -> None:
    """The synthetic images in CIFAR-10's on-disk format (what torchvision's download leaves)."""
    import pickle

    train_x, train_y, test_x, test_y = synthetic_cifar(n_train)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    chunks = [(f"data_batch_{i + 1}", part) for i, part in
              enumerate(zip(torch.tensor_split(train_x, 5), torch.tensor_split(train_y, 5)))]
    for name, (x, y) in chunks + [("test_batch", (test_x, test_y))]:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({"data": x.reshape(len(x), -1).numpy(), "labels": y.tolist()}, f)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)


class LocalCIFAR10(datasets.CIFAR10):
    """torchvision's CIFAR10 over locally written files: no md5 check (the files are ours)."""

    train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
    test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
    meta = {**datasets.CIFAR10.meta, "md5": None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-size", type=int, default=6400, help="synthetic training images")
    p.add_argument("--batch-size", type=int, default=64, help="PER-WORKER batch")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--loader-workers", type=int, default=4,
                   help="DataLoader worker processes per rank (the seed's: 4)")
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
    root = os.path.join(tempfile.gettempdir(), f"seed_ddp_cifar_{args.train_size}_"
                        f"{os.environ.get('TORCHELASTIC_RUN_ID', os.getppid())}")
    if rank == 0:
        write_cifar_files(root, args.train_size)
    dist.barrier()
    train_dataset = LocalCIFAR10(root=root, train=True, download=False,
                                 transform=transforms.ToTensor())
    train_sampler = DistributedSampler(train_dataset, num_replicas=world, rank=rank)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False,
                              num_workers=args.loader_workers,
                              pin_memory=device.type == "cuda", sampler=train_sampler,
                              persistent_workers=args.loader_workers > 0)

    model = Net().to(device)
    net = model
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    per_epoch = []  # (images, seconds) of this worker
    first_step_at = None
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        images = 0
        start = time.perf_counter()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
            optimizer.step()
            images += len(target)
            if first_step_at is None:
                first_step_at = time.time()
            if args.log_every and batch_idx % args.log_every == 0:
                print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                    epoch, batch_idx * len(data), len(train_sampler),
                    100. * batch_idx / len(train_loader), loss.item()), flush=True)
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
    if rank == 0:  # the second seed's "accuracy of the network on the test images"
        test_dataset = LocalCIFAR10(root=root, train=False, download=False,
                                    transform=transforms.ToTensor())
        correct = total = 0
        net.eval()
        with torch.no_grad():
            for data, target in DataLoader(test_dataset, batch_size=1000):
                correct += (net(data.to(device)).argmax(1).cpu() == target).sum().item()
                total += len(target)
        test_acc = correct / total
        print('Accuracy of the network on the %d test images: %.2f %%' % (total, 100 * test_acc))
    dist.barrier()
    if rank == 0:
        result = {
            "benchmark": "seed_ddp", "world": world, "backend": backend,
            "device": str(device), "threads_per_worker": torch.get_num_threads(),
            "per_worker_batch": args.batch_size, "epochs": args.epochs,
            "train_size": args.train_size, "loader_workers": args.loader_workers,
            "warmup_epochs": args.warmup_epochs if len(per_epoch) > args.warmup_epochs else 0,
            "images_per_s_per_worker": sum(e["steady"] for e in everyone) / world,
            "steady_images_per_s_by_rank": [round(e["steady"], 1) for e in everyone],
            "epoch_images_per_s_by_rank": [[round(v, 1) for v in e["epochs"]]
                                           for e in everyone],
            "first_step_at": first_step_at, "test_acc": test_acc,
        }
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
