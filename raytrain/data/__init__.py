"""Training data, as sources of uint8 batches for the worker loop.

``builtin``: the built-in datasets (cifar10/100, digits, synthetic) as in-memory uint8 tensors,
their per-rank shards and the on-device ``Augment``. ``streaming``: your own images (image
folders, Parquet shards) listed once, decoded and cropped by Ray Data tasks, streamed to the
workers (its driver side imports Ray; its worker side only torch).

    from raytrain.data import load_dataset
    data = load_dataset("digits")
"""

from raytrain.data.builtin import (Augment, Dataset, InMemory, batches,  # noqa: F401
                                   crop_and_flip, epoch_shard, eval_shard, load_dataset,
                                   steps_per_epoch)
