"""``python -m raytrain.loop`` / ``torchrun ... -m raytrain.loop``: the worker loop without Ray.

The code lives in ``raytrain.worker`` (``loop``: the loop, ``local``: this entry point).
"""

from raytrain.worker.local import main  # noqa: F401
from raytrain.worker.loop import (Worker, autocast_dtype, evaluate, make_optimizer,  # noqa: F401
                                  make_scheduler, prepare_model, run_worker, train_epoch,
                                  train_step)

if __name__ == "__main__":
    raise SystemExit(main())
