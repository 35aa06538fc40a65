"""Decoding encoded images into uint8 crops: the crop geometry, the PIL decode Ray Data's tasks
run (``DecodeFn``), and the batched torchvision decode a worker runs (``decode_batch``).

    fn = DecodeFn(fs, 224, train=True, seed=0)      # a map_batches function: rows -> crops
    out = fn({"path": paths, "label": labels, "row": rows})   # {"image": uint8 [B,3,224,224], ...}

The tasks read and decode with PIL, convert any mode (L, RGBA, CMYK, P, ...) to RGB and emit
``image`` uint8 ``[B, 3, N, N]`` and ``label`` int64. Training crops are torchvision's
RandomResizedCrop (scale (0.08, 1), ratio (3/4, 4/3)), drawn from a generator seeded by
``(seed, epoch, row)``: reproducible given the seed; evaluation (and ``augment=False``) resizes
the short side to ``N*256/224`` and center-crops N, as one PIL resize over the crop box. JPEGs
are opened in PIL's draft mode (DCT scaling by 1/2, 1/4, 1/8 while the crop stays >= N pixels):
what it buys is measured in benchmarks/folder_ingest.py. Flip, normalise and channels_last
happen on the worker device (``raytrain.data.Augment``).

With ``bytes_only=True`` the tasks only fetch bytes and the worker decodes a batch with
``torchvision.io.decode_jpeg`` (nvjpeg when ``device`` is CUDA; see ``decode_batch``).

Epoch: the epoch used for seeding is Ray Data's execution index of the dataset (it counts the
executions of a pipeline; in Train each epoch's iteration is one execution of the shard's
dataset copy), read through ``ray_compat.data_execution_index`` (a private field).

Nothing here imports torch at module level: Ray Data's task processes unpickle ``DecodeFn``
and would otherwise pay 1.3 s of torch import each (tests/test_architecture.py checks).
"""

from __future__ import annotations

import io
import math
import zlib

import numpy as np

from raytrain import ray_compat

RRC_SCALE, RRC_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
EVAL_RESIZE = 256 / 224


# ---------------------------------------------------------------------------- crop geometry


def epoch_index() -> int:
    """Ray Data's execution index of the running pipeline: the epoch (from 0) under Train."""
    return ray_compat.data_execution_index()


def crop_rng(seed: int, epoch: int, key: int) -> np.random.Generator:
    """The generator of one row's crop: a pure function of (seed, epoch, row key)."""
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch, key & 0xFFFFFFFFFFFF])


def rrc_params(width: int, height: int, rng: np.random.Generator,
               scale=RRC_SCALE, ratio=RRC_RATIO) -> tuple[float, float, float, float]:
    """torchvision RandomResizedCrop.get_params with a numpy generator: (left, top, w, h)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        ar = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * ar)))
        h = int(round(math.sqrt(target / ar)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    in_ratio = width / height  # fallback: whole image, clamped to the ratio range
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def eval_box(width: int, height: int, size: int) -> tuple[float, float, float, float]:
    """Resize short side to size*256/224, center crop size: the box in source pixels."""
    short = min(width, height)
    side = short * size / int(size * EVAL_RESIZE)  # crop side in source pixels
    return (width - side) / 2, (height - side) / 2, side, side


def crop_box(width: int, height: int, size: int, train: bool, rng) -> tuple[float, ...]:
    return rrc_params(width, height, rng) if train else eval_box(width, height, size)


def open_image(data: bytes):
    """PIL image, with a one-line error for files PIL cannot identify."""
    from PIL import Image

    return Image.open(io.BytesIO(data))


def to_rgb(im):
    """Any PIL mode -> RGB, as torchvision's ``pil_loader`` does."""
    return im if im.mode == "RGB" else im.convert("RGB")


def decode_crop(data: bytes, size: int, train: bool, rng, draft: bool = True) -> np.ndarray:
    """Encoded image -> uint8 [size, size, 3] RGB crop (PIL; draft mode for JPEG)."""
    from PIL import Image

    im = open_image(data)
    full_w, full_h = im.size
    left, top, w, h = crop_box(full_w, full_h, size, train, rng)
    if draft and im.format == "JPEG":
        # Ask for a size at which the crop box still covers >= size pixels each way.
        want = (math.ceil(full_w * size / w), math.ceil(full_h * size / h))
        im.draft("RGB" if im.mode in ("RGB", "YCbCr") else im.mode, want)
    sx, sy = im.size[0] / full_w, im.size[1] / full_h
    im = to_rgb(im)
    box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    out = im.resize((size, size), Image.BILINEAR, box=box)
    return np.asarray(out, dtype=np.uint8)


def read_files(fs, paths) -> list[bytes]:
    """Whole files through a pyarrow filesystem; threads for object stores (latency-bound)."""
    import pyarrow.fs as pafs

    def one(p):
        with fs.open_input_stream(p) as f:
            return f.read()

    if not isinstance(fs, pafs.LocalFileSystem) and len(paths) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, paths))
    return [one(p) for p in paths]


def image_bytes(col) -> list[bytes]:
    """An ``image`` column as bytes: binary values or HF's {bytes, path} structs."""
    return [v["bytes"] if isinstance(v, dict) else v for v in col]


def _key_of(batch: dict, i: int, data: bytes) -> int:
    if "row" in batch:
        return int(batch["row"][i])
    return zlib.crc32(data)  # Parquet rows have no index: the content keys the crop


NAME_BYTES = 256  # a bad image's name travels with its batch as the tail of its UTF-8 bytes


def bad_rows(column) -> list[tuple[int, str]]:
    """The ``bad`` column of a batch (uint8 [B, NAME_BYTES], zero rows for good images) ->
    (row, name) of each image that could not be decoded."""
    rows = np.asarray(column)
    return [(int(i), bytes(rows[i]).rstrip(b"\0").decode("utf-8", "replace"))
            for i in np.flatnonzero(rows.any(axis=1))]


def _name_row(name: str) -> np.ndarray:
    data = name.encode("utf-8")[-NAME_BYTES:] or b"?"
    return np.frombuffer(data.ljust(NAME_BYTES, b"\0"), np.uint8)


def why_unreadable(err: BaseException) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(err, UnidentifiedImageError):  # its message names an in-memory BytesIO
        return "not an image file PIL can read"
    return f"{type(err).__name__}: {str(err).strip()[:100]}"


class DecodeFn:
    """The Ray Data task function: rows (path or image bytes, label) -> uint8 crops.

    A plain picklable callable, run by ``map_batches`` as tasks (no ``concurrency``).
    ``bytes_only``: fetch the encoded bytes and pass them on (decoded on the worker).
    An image that cannot be decoded does not fail the task (Ray would retry it, then fail the
    worker, which Train restarts: the same file again, --max-failures times): its row is
    zeros and its name is in the ``bad`` column; the worker loop stops the run or skips it.
    """

    def __init__(self, fs, size: int, train: bool, seed: int,
                 bytes_only: bool = False, draft: bool = True):
        # The driver's filesystem object travels pickled: it keeps the endpoint and region the
        # driver resolved; credentials come from each node's own environment/instance profile.
        self.fs, self.size, self.train, self.seed = fs, size, train, seed
        self.bytes_only, self.draft = bytes_only, draft

    def __call__(self, batch: dict) -> dict:
        if "image" in batch:
            datas = image_bytes(batch["image"])
        else:
            datas = read_files(self.fs, list(batch["path"]))
        n = len(datas)
        labels = np.asarray(batch["label"], dtype=np.int64)
        keys = np.array([_key_of(batch, i, datas[i]) for i in range(n)], dtype=np.int64)
        names = batch.get("path")
        epoch = epoch_index()
        if self.bytes_only:
            return {"bytes": np.array(datas, dtype=object), "label": labels, "key": keys,
                    "epoch": np.full(n, epoch, np.int64),
                    "name": np.array([str(names[i]) if names is not None else f"row key "
                                      f"{keys[i]}" for i in range(n)], dtype=object)}
        out = np.zeros((n, self.size, self.size, 3), np.uint8)
        bad = np.zeros((n, NAME_BYTES), np.uint8)
        for i, data in enumerate(datas):
            try:
                out[i] = decode_crop(data, self.size, self.train,
                                     crop_rng(self.seed, epoch, int(keys[i])), self.draft)
            except Exception as err:  # PIL raises many kinds for a corrupt or truncated file
                name = names[i] if names is not None else f"row key {keys[i]}"
                bad[i] = _name_row(f"{name} ({why_unreadable(err)})")
        return {"image": np.ascontiguousarray(out.transpose(0, 3, 1, 2)), "label": labels,
                "bad": bad}



def decode_batch(datas, size: int, train: bool, seed: int, epoch: int, keys, device="cpu",
                 names=None):
    """Encoded images -> (uint8 [B, 3, size, size] on ``device``, [(row, name)] of bad ones),
    with
    ``torchvision.io``.

    JPEGs are decoded together by ``decode_jpeg`` (one batched nvjpeg call when ``device`` is
    CUDA); other formats, or JPEGs it refuses (CMYK on GPU), by ``decode_image`` on the CPU.
    Crops use the same boxes as the CPU path, resized with antialiasing. An image neither can
    decode is zeros, and its row and name (``names[i]``) are in the returned list.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg
    from torchvision.transforms.v2.functional import resized_crop

    device = torch.device(device)
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    is_jpeg = [bytes(d[:2]) == b"\xff\xd8" for d in datas]
    images: list = [None] * len(datas)
    jpeg_idx = [i for i, j in enumerate(is_jpeg) if j]
    if jpeg_idx:
        try:
            decoded = decode_jpeg([tensors[i] for i in jpeg_idx], mode=ImageReadMode.RGB,
                                  device=device)
            for i, img in zip(jpeg_idx, decoded):
                images[i] = img
        except RuntimeError:
            pass  # fall back to one at a time below
    out = torch.zeros((len(datas), 3, size, size), dtype=torch.uint8, device=device)
    bad = []
    for i, img in enumerate(images):
        try:
            if img is None:
                img = decode_image(tensors[i], mode=ImageReadMode.RGB).to(device)
            h, w = img.shape[-2:]
            left, top, cw, ch = crop_box(w, h, size, train, crop_rng(seed, epoch, int(keys[i])))
            t, l = int(round(top)), int(round(left))
            out[i] = resized_crop(img, t, l, max(1, int(round(ch))), max(1, int(round(cw))),
                                  [size, size], antialias=True)
        except RuntimeError as err:
            name = names[i] if names is not None else f"row key {keys[i]}"
            bad.append((i, f"{name} ({why_unreadable(err)})"))
    return out, bad

