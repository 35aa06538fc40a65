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

``torch.__version__`` leaves the worker as a plain ``str``: it is a ``TorchVersion`` (a str
subclass in ``torch.torch_version``), and Ray Train's state callback sends it from rank 0 to the
controller and on to the Train state actor, where unpickling it imported all of torch (2-5 s
of CPU in the state actor, measured with ``PYTHONPROFILEIMPORTTIME``), in processes that
otherwise never need torch (``ray_compat.TorchBackendConfig``).
"""

from __future__ import annotations

import importlib

# In the order the worker needs them; torch._dynamo: DDP's constructor reads
# torch._dynamo.utils.get_optimize_ddp_mode() (torch 2.14 nn/parallel/distributed.py), and
# torch.optim.Optimizer's imports it too (1.0 s in a 1-worker run's first step without it here).
MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "raytrain.worker.loop")
HOOK = "raytrain.worker.warm.start"


def start() -> None:
    """Import ``MODULES`` (an error surfaces again at the real import, with its traceback),
    then send torch's version as a plain str (``plain_torch_version``)."""
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - imported again where it is used
            return
    plain_torch_version()


def plain_torch_version() -> None:
    """Ray serialises ``torch.__version__`` from this process as the str it equals."""
    import ray.util
    import torch

    ray.util.register_serializer(type(torch.__version__), serializer=str, deserializer=str)
