"""Evidence for a faster ``raytrain.data.Augment``: the current one vs two rewrites.

    python benchmarks/augment_variants.py             # CPU, 1 thread, batches 64 and 512
    python benchmarks/augment_variants.py --device cuda --batches 512 2048
    python benchmarks/augment_variants.py --quick

Variants, each uint8 [B,3,32,32] -> normalised float32 with random crop (pad 4) and flip:
  current    ``raytrain.data.Augment``: float normalise, zero-pad the float image, gather with
             four broadcast index tensors, then ``torch.where(flip, x.flip(3), x)``.
  uint8      the same ops, but crop/flip on the uint8 image, normalise last (one addcmul).
  fused      uint8 pad + ONE ``gather`` on the flattened image whose indices fold the crop
             offset and the flip in (flipped rows read columns backwards), normalise last.
Both rewrites pad with black pixels before normalising, as torchvision's ``RandomCrop(32,
padding=4)`` does (the current code pads the *normalised* image with 0 = the mean colour).
The script also checks that every ``fused`` output is an exact crop (or mirrored crop) of the
padded, normalised input. Images/s per variant: median of --rounds passes over --images
images (order rotated each round); ratio to ``current``. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from raytrain.data import Augment, load_dataset


def random_crop(x: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """The uint8-first variant's crop (raytrain's before the fused gather): zero-pad by ``pad``
    and take a random HxW window per image, as one advanced-index gather."""
    b, _, h, w = x.shape
    xp = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b, 1), device=x.device, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (b, 1), device=x.device, generator=generator)
    rows = (dy + torch.arange(h, device=x.device)).view(b, 1, h, 1)
    cols = (dx + torch.arange(w, device=x.device)).view(b, 1, 1, w)
    batch = torch.arange(b, device=x.device).view(b, 1, 1, 1)
    chans = torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1)
    return xp[batch, chans, rows, cols]


class Variants:
    def __init__(self, data, device: torch.device, pad: int = 4):
        self.pad = pad
        self.current = Augment(data.mean, data.std, device, crop_pad=pad, flip=True)
        mean = torch.tensor(data.mean, device=device).view(1, -1, 1, 1) * 255
        self.inv_std = 1.0 / (torch.tensor(data.std, device=device).view(1, -1, 1, 1) * 255)
        self.shift = -mean * self.inv_std

    def uint8(self, x, gen):
        x = random_crop(x, self.pad, gen)
        flip = torch.rand(x.shape[0], device=x.device, generator=gen) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
        return torch.addcmul(self.shift, x.float(), self.inv_std)

    def fused(self, x, gen):
        b, c, h, w = x.shape
        p, dev = self.pad, x.device
        xp = F.pad(x, (p, p, p, p))  # uint8 zeros: black, like torchvision's RandomCrop
        dy = torch.randint(0, 2 * p + 1, (b, 1), device=dev, generator=gen)
        dx = torch.randint(0, 2 * p + 1, (b, 1), device=dev, generator=gen)
        flip = torch.rand(b, 1, device=dev, generator=gen) < 0.5
        cols_ = torch.arange(w, device=dev)
        cols = dx + torch.where(flip, cols_.flip(0), cols_)  # [b, w]
        rows = dy + torch.arange(h, device=dev)  # [b, h]
        lin = (rows.view(b, h, 1) * (w + 2 * p) + cols.view(b, 1, w)).view(b, 1, h * w)
        out = xp.view(b, c, -1).gather(2, lin.expand(b, c, h * w)).view(b, c, h, w)
        return torch.addcmul(self.shift, out.float(), self.inv_std)

    def all(self):
        return {"current": lambda x, g: self.current(x, g), "uint8": self.uint8,
                "fused": self.fused}


def check_fused(v: Variants, x: torch.Tensor, gen) -> int:
    """How many fused outputs are exact crops (or mirrored crops) of the padded input."""
    y = v.fused(x, gen)
    p = v.pad
    full = torch.addcmul(v.shift, F.pad(x, (p,) * 4).float(), v.inv_std)
    ok = 0
    for i in range(len(x)):
        ok += any(torch.equal(win, y[i]) or torch.equal(win.flip(2), y[i])
                  for dy in range(2 * p + 1) for dx in range(2 * p + 1)
                  for win in [full[i, :, dy:dy + 32, dx:dx + 32]])
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.rounds, args.batches = 1024, 1, [64]
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    data = load_dataset("synthetic", synthetic_size=args.images).to(dev)
    v = Variants(data, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    for batch in args.batches:
        idxs = torch.randperm(args.images, device=dev)[: args.images // batch * batch]
        idxs = idxs.view(-1, batch)
        res = {k: [] for k in v.all()}
        names = list(res)
        for r in range(args.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                fn, gen = v.all()[name], torch.Generator(device=dev).manual_seed(r)
                fn(data.train_x[idxs[0]], gen)  # warm-up
                sync()
                t0 = time.perf_counter()
                for idx in idxs:
                    fn(data.train_x[idx], gen)
                sync()
                res[name].append(idxs.numel() / (time.perf_counter() - t0))
        base = statistics.median(res["current"])
        out[batch] = {}
        for name, vals in res.items():
            m = statistics.median(vals)
            out[batch][name] = m
            print(f"batch {batch:5d}  {name:<8} {m:>12,.0f} images/s  {m / base:5.2f}x current "
                  f"(min {min(vals):,.0f}, max {max(vals):,.0f})", flush=True)
    ok = check_fused(v, data.train_x[:16], torch.Generator(device=dev).manual_seed(0))
    print(f"fused outputs that are exact (mirrored) crops of the padded input: {ok}/16")
    print(json.dumps({"benchmark": "augment_variants", "device": str(dev),
                      "threads": args.threads, "images_per_s": out, "fused_exact": ok}))
    return 0 if ok == 16 else 1


if __name__ == "__main__":
    sys.exit(main())
