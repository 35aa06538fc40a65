"""Training data, as sources of uint8 batches for the worker loop.

``builtin``: the built-in datasets (cifar10/100, digits, synthetic) as in-memory uint8 tensors,
their per-rank shards and the on-device ``Augment``. ``streaming``: your own images (image
folders, Parquet shards) listed once, decoded and cropped by Ray Data tasks, streamed to the
workers (its driver side imports Ray; its worker side only torch).

    from raytrain.data import load_dataset
    data = load_dataset("digits")
"""


_BUILTIN = ("Augment", "Dataset", "InMemory", "batches", "crop_and_flip", "epoch_shard",
            "eval_shard", "load_dataset", "steps_per_epoch")
__all__ = list(_BUILTIN)


def __getattr__(name: str):
    # Lazy: Ray Data's decode tasks import raytrain.data.streaming, which needs no torch; an
    # eager import of builtin here cost each task process 1.3 s of torch import.
    if name in _BUILTIN:
        from raytrain.data import builtin

        return getattr(builtin, name)
    raise AttributeError(f"module 'raytrain.data' has no attribute {name!r}")
