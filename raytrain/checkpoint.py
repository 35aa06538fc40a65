"""Training-state checkpoints: one explicit dict, and resume mirrors save.

Everything in it is a tensor, number, string, list, tuple or dict, so it loads with
``torch.load(weights_only=True)``: a checkpoint can never run code when read.
"""

from __future__ import annotations

import errno
import io
import os
import random
import sys
import warnings
from typing import Any

import numpy as np
import torch

from raytrain import files, storage
from raytrain.errors import RaytrainError

FORMAT = "raytrain-checkpoint-v1"
STATE_FILE = files.STATE_FILE


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def training_state(model, optimizer, scheduler, scaler, epoch: int, step: int,
                   config: dict[str, Any], ema=None, metrics: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The full state after ``epoch`` epochs (``model`` is the unwrapped module). With an EMA
    (``--ema``), its state too, and ``export`` says which weights scored better this epoch
    (what model.pt gets)."""
    extra: dict[str, Any] = {}
    if ema is not None:
        better = (metrics or {}).get("test_acc_ema", -1) > (metrics or {}).get("test_acc", 0)
        extra = {"ema": ema.state_dict(), "export": "ema" if better else "model"}
    return extra | {
        "format": FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "epoch": epoch,
        "step": step,
        "rng": rng_state(),
        "config": config,
    }


def restore(state: dict[str, Any], model, optimizer, scheduler, scaler, ema=None
            ) -> tuple[int, int]:
    """Load ``state`` into the training objects; returns (epochs done, global step)."""
    model.load_state_dict(state["model"])
    if ema is not None:  # a run that turns --ema on when resumed starts its average here
        ema.load_state_dict(state["ema"]) if "ema" in state else \
            ema.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # The schedule's length is this run's (--resume with other --epochs): the saved step count
    # continues on it instead of on the old length, which OneCycleLR would run past and fail.
    length = {k: v for k, v in vars(scheduler).items()
              if k in ("total_steps", "_schedule_phases", "T_max")}
    scheduler.load_state_dict(state["scheduler"])
    if any(vars(scheduler).get(k) != v for k, v in length.items()):
        vars(scheduler).update(length)
        if hasattr(scheduler, "_get_closed_form_lr"):  # cosine steps from the current lr:
            for group, lr in zip(optimizer.param_groups,  # restart it on the new curve
                                 scheduler._get_closed_form_lr()):
                group["lr"] = lr
    if state["scaler"] is not None and scaler is not None:
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    return state["epoch"], state["step"]


def save(state: dict[str, Any] | bytes, directory: str, export: bytes | None = None) -> str:
    """Write ``state`` (or its ``serialize``d bytes) into ``directory`` atomically (temp file,
    then rename); ``export`` (``serialize``d ``model_weights_of``), as model.pt before it."""
    if export is not None:
        files.atomic_write(os.path.join(directory, files.MODEL_FILE), export)
    path = os.path.join(directory, STATE_FILE)
    if isinstance(state, bytes):
        files.atomic_write(path, state)
        return path
    with files.replacing(path) as tmp:
        torch.save(state, tmp)
    return path


def serialize(state: dict[str, Any]) -> bytes:
    """``state`` as ``save`` writes it, taken now: training may go on changing the tensors."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def load_file(path: str) -> Any:
    """``torch.load`` with weights_only=True; any failure is one line naming the file."""
    if os.path.isdir(path):
        path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(path):
        raise RaytrainError(f"{path}: no such checkpoint file")
    try:
        with warnings.catch_warnings():  # its "Detected pickle protocol" note on a plain
            warnings.simplefilter("ignore", UserWarning)  # pickle: the refusal says it all
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise RaytrainError(f"{path}: cannot load checkpoint: {files.why_unloadable(path, err)}"
                            ) from None


def load_state(directory: str) -> dict[str, Any]:
    """A raytrain training checkpoint from a checkpoint directory."""
    state = load_file(directory)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise RaytrainError(f"{directory}: not a raytrain training checkpoint")
    return state


def model_weights(path: str) -> dict[str, torch.Tensor]:
    """Model weights from a checkpoint directory, a state.pt or an exported model.pt."""
    return model_weights_of(load_file(path), path)


def model_weights_of(state: Any, path: str) -> dict[str, torch.Tensor]:
    """The model weights in ``state``, loaded from ``path``."""
    if isinstance(state, dict) and state.get("format") == FORMAT:
        if state.get("export") == "ema":  # --ema scored better: its weights, as a state_dict
            state = {k.removeprefix("module."): v for k, v in state["ema"].items()
                     if k != "n_averaged"}
        else:
            state = state["model"]
    if not isinstance(state, dict) or not state or \
            not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RaytrainError(f"{path}: not a model state_dict or raytrain checkpoint")
    return state


def export(directory: str, path: str) -> None:
    """Write ``model_weights(directory)`` to ``path`` (a model.pt) atomically."""
    with files.replacing(path) as tmp:
        torch.save(model_weights(directory), tmp)


def storage_failure(what: str, err: OSError, storage_path: str, kept: str) -> str:
    """The one line for a write to --storage-path that failed (a full disk, failing storage):
    what failed and why, what is still there (``kept``), and what to do."""
    why = (f"[Errno {err.errno}] {os.strerror(err.errno)}" if err.errno else
           storage.first_line(err))
    fix = "free space" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "fix the storage"
    return (f"{what}: {why} (--storage-path {storage_path}); {kept}; {fix} and rerun the same "
            "command to resume")


if __name__ == "__main__":  # python -m raytrain.checkpoint CHECKPOINT_DIR MODEL_PT: the driver's
    try:                     # export where a checkpoint has no model.pt (it imports no torch)
        export(sys.argv[1], sys.argv[2])
    except RaytrainError as err:
        sys.exit(str(err))
