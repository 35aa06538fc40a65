"""Where a run's workers meet: the torch process group's store, served before anyone dials it.

Ray 2.60's ``_TorchBackend`` has every rank call ``init_process_group("env://")`` at once;
rank 0's call starts the TCPStore server, and a rank that dials before it listens waits out
torch's 1 s connect backoff. Measured on 2 cores, digits, 2 workers on a running cluster: the
group took 1.0 s to form in a run that met it (the controller's BackendSetupCallback: 0.27 s in
most runs, 0.59-1.0 s in others), against 0.05 s with the store already listening.
So rank 0 serves the store first (``serve``, on a port it picks: no free-port race), then every
rank joins over it (``join``). Public torch and Ray API only; torch is imported where it runs
(the Train controller hands these functions to the workers without importing torch).
"""

from __future__ import annotations

import os
from datetime import timedelta

_STORE: list = []  # on rank 0: the TCPStore server, held while its process group lives


def serve(timeout_s: int) -> tuple[str, int]:
    """On rank 0: start the store; returns the address every rank dials."""
    import ray.util
    import torch.distributed as dist

    addr = ray.util.get_node_ip_address()
    _STORE[:] = [dist.TCPStore(addr, 0, None, True, timedelta(seconds=timeout_s),
                               wait_for_workers=False)]
    return addr, _STORE[0].port


def join(addr: str, port: int, backend: str, world_rank: int, world_size: int,
         timeout_s: int) -> None:
    """On every rank: the default process group over rank 0's store (MASTER_ADDR/PORT set as
    for ``env://``, for code that reads them)."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    if backend == "nccl" and not {"TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                  "TORCH_NCCL_BLOCKING_WAIT"} & set(os.environ):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # as Ray: a hung NCCL op fails
    timeout = timedelta(seconds=timeout_s)
    store = _STORE[0] if world_rank == 0 else dist.TCPStore(addr, port, None, False, timeout)
    dist.init_process_group(backend, store=store, rank=world_rank, world_size=world_size,
                            timeout=timeout)


def leave() -> None:
    """After the group is destroyed: the store goes with it."""
    _STORE.clear()
