"""Imports a Train worker needs, started in a thread the moment its process starts.

Ray runs ``start`` in every Train worker process before the worker actor exists (a setup hook
in the workers' runtime env, ``ray_compat.setup_hook_env``). Until the train function runs, a
worker waits on the controller (its actor's creation, the process group, the other workers)
with a core often idle; these imports then fill it instead of following it. Measured on 2
cores, digits, 2 workers: torch 1.6 s, and DDP's constructor imports torch._dynamo (1.3 s
alone, 2.7-2.9 s of the "model" phase with both workers importing at once).

Only torch and raytrain's Ray-free worker loop: Ray's own modules are imported by the main
thread at the same time, and two threads importing into each other's modules could deadlock
on Python's import locks. No CUDA call: the GPUs this process may see are set later.
"""

from __future__ import annotations

import importlib
import threading

# In the order the worker's main thread needs them; torch._dynamo: DDP's constructor reads
# torch._dynamo.utils.get_optimize_ddp_mode() (torch 2.14 nn/parallel/distributed.py).
MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "raytrain.worker.loop")
HOOK = "raytrain.worker.warm.start"


def start() -> None:
    """Import ``MODULES`` in a daemon thread (an error surfaces at the real import)."""
    def load() -> None:
        for name in MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - imported again where it is used
                return

    threading.Thread(target=load, name="raytrain-warm", daemon=True).start()
