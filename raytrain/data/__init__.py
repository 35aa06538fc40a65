"""Training data. ``builtin``: the built-in datasets (cifar10/100, digits, synthetic) as
in-memory uint8 tensors, their per-rank shards and the on-device ``Augment``.

    from raytrain.data import load_dataset
    data = load_dataset("digits")
"""

from raytrain.data.builtin import (Augment, Dataset, batches, crop_and_flip,  # noqa: F401
                                   epoch_shard, eval_shard, load_dataset, steps_per_epoch)
