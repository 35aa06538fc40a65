"""The training recipe's extras, torch only: mixup/cutmix on the device, an EMA of the weights,
warmup before any schedule. ``worker/loop.py`` uses them; each is off by default.

    mix = Mixer(mixup=0.2, cutmix=1.0, seed=0, epoch=3, rank=0)
    x, y_a, y_b, lam = mix(x, y)          # loss = lam * CE(y_a) + (1 - lam) * CE(y_b)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Mixer:
    """Batched mixup (Zhang et al. 2018) and cutmix (Yun et al. 2019) after augmentation,
    on the device. With both on, one of the two per batch (even odds), as timm does. The
    mixing draws come from a generator seeded by (seed, epoch, rank): a run resumed at an
    epoch boundary draws the same ones."""

    def __init__(self, mixup: float, cutmix: float, seed: int, epoch: int, rank: int):
        self.mixup, self.cutmix = mixup, cutmix
        self.rng = np.random.default_rng([seed & 0xFFFFFFFF, epoch, rank, 0x6D6978])

    @property
    def on(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        if not self.on or len(y) < 2:
            return x, y, y, 1.0
        use_cutmix = self.cutmix > 0 and (self.mixup <= 0 or self.rng.random() < 0.5)
        alpha = self.cutmix if use_cutmix else self.mixup
        lam = float(self.rng.beta(alpha, alpha))
        perm = torch.from_numpy(self.rng.permutation(len(y))).to(x.device)
        if not use_cutmix:
            return x * lam + x[perm] * (1 - lam), y, y[perm], lam
        h, w = x.shape[-2:]
        cut_h, cut_w = int(h * np.sqrt(1 - lam)), int(w * np.sqrt(1 - lam))
        cy, cx = int(self.rng.integers(h)), int(self.rng.integers(w))
        top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
        left, right = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
        x = x.clone()
        x[..., top:bottom, left:right] = x[perm][..., top:bottom, left:right]
        lam = 1 - (bottom - top) * (right - left) / (h * w)  # the pasted box's exact share
        return x, y, y[perm], lam


def make_ema(model: nn.Module, decay: float):
    """An exponential moving average of ``model``'s weights, or None (``decay`` 0). BatchNorm's
    running statistics are averaged with the weights (``use_buffers``), so the EMA model is
    evaluated with statistics that match its weights. Updated after every optimizer step on
    every rank: DDP keeps the replicas identical, so the EMAs are too, without a broadcast."""
    if decay <= 0:
        return None
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def with_warmup(optimizer: torch.optim.Optimizer, main, warmup_steps: int):
    """``main`` after ``warmup_steps`` of linear warmup from 1% of the learning rate."""
    if warmup_steps <= 0:
        return main
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, end_factor=1.0,
                                             total_iters=warmup_steps)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, main], [warmup_steps])
