"""Imports a Train worker needs, done the moment its process starts.

Ray runs ``start`` in every Train worker process before the worker actor exists (a setup hook
in the workers' runtime env, ``ray_compat.setup_hook_env``). Measured on 2 cores, digits,
2 workers: torch 1.6 s, and DDP's constructor imports torch._dynamo (1.3 s alone, 2.7-2.9 s of
the "model" phase with both workers importing at once); done here, they are out of the way
before the controller's rendezvous, not in the middle of it.

On the process's one thread, before Ray runs anything in it: an earlier version imported in a
second thread while the main thread imported Ray Train, and two threads importing torch can
leave it half-initialised ("partially initialized module 'torch'", seen in CI on the driver).
No CUDA call: the GPUs this process may see are set later.
"""

from __future__ import annotations

import importlib

# In the order the worker needs them; torch._dynamo: DDP's constructor reads
# torch._dynamo.utils.get_optimize_ddp_mode() (torch 2.14 nn/parallel/distributed.py).
MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "raytrain.worker.loop")
HOOK = "raytrain.worker.warm.start"


def start() -> None:
    """Import ``MODULES`` (an error surfaces again at the real import, with its traceback)."""
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - imported again where it is used
            return
