"""Training data, as sources of uint8 batches for the worker loop.

``builtin``: the built-in datasets (cifar10/100, digits, synthetic) as in-memory uint8 tensors,
their per-rank shards and the on-device ``Augment``. Your own images (image folders, Parquet
shards) stream through Ray Data, one module per job: ``listing`` (list once on the driver,
check the layout), ``decode`` (crop geometry; the PIL decode Ray Data's tasks run, the batched
torchvision decode a worker runs), ``pipeline`` (the Ray Data datasets, the Train split, the
CPUs they get; driver side) and ``sources`` (a rank's shards as the loop's batches; worker
side). Only ``builtin`` imports torch at module level: Ray Data's task processes import
``decode`` and ``pipeline``, which load torch (or Ray) only inside the functions that use it.

    from raytrain.data import load_dataset
    data = load_dataset("digits")
"""


_BUILTIN = ("Augment", "Dataset", "InMemory", "batches", "crop_and_flip", "epoch_shard",
            "eval_shard", "load_dataset", "steps_per_epoch")
__all__ = list(_BUILTIN)


def __getattr__(name: str):
    # Lazy: Ray Data's decode tasks import raytrain.data.decode and .pipeline, which need no
    # torch; an eager import of builtin here cost each task process 1.3 s of torch import.
    if name in _BUILTIN:
        from raytrain.data import builtin

        return getattr(builtin, name)
    raise AttributeError(f"module 'raytrain.data' has no attribute {name!r}")
