"""The training recipe's flags (issue 18): each changes training as it should, each is
checkpointed and resumed exactly. The per-worker loop runs in this process (no Ray: the same
step a Ray worker runs), on the bundled digits, CPU only.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from raytrain import checkpoint
from raytrain.config import ConfigError, TrainConfig
from raytrain.models import build_model
from raytrain.worker.loop import Worker, make_scheduler, run_worker, train_step
from raytrain.worker.recipe import Mixer

CPU = Worker(0, 0, 1, torch.device("cpu"))
BASE = {"dataset": "digits", "num_workers": 1, "batch_size": 64, "model": "lenet", "seed": 1}


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _run(epochs: int, resume=None, **flags) -> tuple[dict, dict]:
    """(metrics by epoch, saved state by epoch) of one in-process run."""
    metrics, states = {}, {}

    def report(m, s):
        metrics[m["epoch"]] = m
        states[m["epoch"]] = _roundtrip(s) if s is not None else None

    run_worker(TrainConfig.from_flat({**BASE, "epochs": epochs, **flags}), CPU, report, resume)
    return metrics, states


@pytest.mark.parametrize("flag,value,says", [
    ("label_smoothing", 1.0, "[0, 1)"), ("mixup", -0.2, ">= 0"), ("cutmix", float("nan"), ">= 0"),
    ("ema", 1.0, "[0, 1)"), ("warmup_epochs", 5, "[0, --epochs)"), ("grad_accum", 0, ">= 1"),
    ("clip_grad", -1.0, ">= 0"), ("grad_accum", 128, "at most --batch-size")])
def test_bad_values_are_one_line_naming_the_flag(flag, value, says):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_flat({**BASE, "epochs": 5, flag: value})
    assert f"--{flag.replace('_', '-')}" in str(err.value) and says in str(err.value)
    assert "\n" not in str(err.value)


def test_label_smoothing_raises_the_loss_floor():
    plain, _ = _run(6)
    smooth, _ = _run(6, label_smoothing=0.3)
    # Smoothed CE over 10 classes with eps 0.3 cannot go below H(0.73, 9 x 0.03) = 1.18
    assert smooth[6]["train_loss"] > 1.18 > plain[6]["train_loss"]
    assert smooth[6]["test_acc"] > 0.8  # and the network still learns


def test_mixup_and_cutmix_mix_images_and_labels():
    x = torch.rand(8, 3, 32, 32)
    y = torch.arange(8)
    mixed, y_a, y_b, lam = Mixer(0.4, 0.0, seed=0, epoch=1, rank=0)(x, y)
    perm = y_b  # labels 0..7: the second labels are the permutation itself
    assert 0 < lam < 1 and torch.equal(y_a, y) and not torch.equal(y_b, y)
    assert torch.allclose(mixed, lam * x + (1 - lam) * x[perm])
    cut, y_a, y_b, lam = Mixer(0.0, 1.0, seed=0, epoch=1, rank=0)(x, y)
    pasted = (cut != x).any(1)  # pixels taken from the other image
    assert torch.equal(cut[pasted.unsqueeze(1).expand_as(cut)],
                       x[y_b][pasted.unsqueeze(1).expand_as(cut)])
    assert abs((1 - lam) - pasted[0].float().mean().item()) < 0.02  # lam = the box's share
    # The same (seed, epoch, rank) draws the same mix: a resumed epoch repeats it
    again = Mixer(0.0, 1.0, seed=0, epoch=1, rank=0)(x, y)
    assert torch.equal(again[0], cut) and again[3] == lam


def test_mixed_batches_train_and_count_accuracy_by_lam():
    m, _ = _run(3, mixup=0.4, cutmix=1.0)
    assert 0 < m[3]["train_acc"] < 1 and m[3]["test_acc"] > 0.5


def test_ema_is_evaluated_and_model_pt_holds_the_better_weights():
    m, states = _run(3, ema=0.9)
    state = states[3]
    raw = state["model"]
    ema = {k.removeprefix("module."): v for k, v in state["ema"].items() if k != "n_averaged"}
    assert set(ema) == set(raw) and any(not torch.equal(ema[k], raw[k]) for k in raw)
    assert "test_acc_ema" in m[3]
    better = "ema" if m[3]["test_acc_ema"] > m[3]["test_acc"] else "model"
    assert state["export"] == better
    exported = checkpoint.model_weights_of(state, "state.pt")
    assert all(torch.equal(exported[k], (ema if better == "ema" else raw)[k]) for k in raw)
    # Forced: an EMA that scored better is what model.pt gets
    state["export"] = "ema"
    assert all(torch.equal(checkpoint.model_weights_of(state, "x")[k], ema[k]) for k in raw)


def test_grad_accum_matches_one_step_of_the_whole_batch():
    torch.manual_seed(0)
    x, y = torch.rand(32, 3, 32, 32), torch.randint(0, 10, (32,))
    models = [build_model("lenet", 10) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_step(models[0], x, y, opts[0], scaler, None, False)
    for i, (xs, ys) in enumerate(zip(x.split(8), y.split(8))):
        train_step(models[1], xs, ys, opts[1], scaler, None, False, accum=4,
                   update=i == 3, zero=i == 0)
    a, b = models[0].state_dict(), models[1].state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_grad_accum_run_updates_once_per_group():
    plain, _ = _run(1, lr_schedule="constant")
    accum, states = _run(1, lr_schedule="constant", grad_accum=4)
    # 1437 images, 64 per worker: 23 batches; with 4 steps of 16 per update: 90 steps,
    # 23 updates (the last with the 2 steps left)
    assert states[1]["scheduler"]["last_epoch"] == 23
    assert accum[1]["train_count"] == plain[1]["train_count"] == 1437


def test_clip_grad_bounds_the_update():
    model = build_model("lenet", 10)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x, y = torch.rand(16, 3, 32, 32), torch.randint(0, 10, (16,))
    train_step(model, x, y, opt, torch.amp.GradScaler("cpu", enabled=False), None, False,
               clip=1e-3)
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum()
                           for p, b in zip(model.parameters(), before)))
    assert 0 < moved.item() <= 1e-3 + 1e-7


def test_warmup_starts_at_one_percent_and_reaches_the_schedule():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = TrainConfig.from_flat({**BASE, "epochs": 3, "lr": 0.5, "lr_schedule": "constant",
                                 "warmup_epochs": 1})
    sched = make_scheduler(opt, cfg, total_steps=30, warmup_steps=10)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(12):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(0.005) and lrs[5] < 0.5 and lrs[11] == pytest.approx(0.5)


def test_resume_with_every_recipe_flag_on_is_bit_identical():
    flags = {"label_smoothing": 0.1, "mixup": 0.2, "cutmix": 1.0, "ema": 0.99,
             "warmup_epochs": 1, "grad_accum": 2, "clip_grad": 1.0}
    _, straight = _run(3, **flags)
    _, resumed = _run(3, resume=straight[1], **flags)
    for part in ("model", "ema"):
        a, b = straight[3][part], resumed[3][part]
        assert all(torch.equal(a[k], b[k]) for k in a), part
