"""Checks that depend on the shape of the Ray cluster a run lands on.

    import ray
    from raytrain.cluster import check_storage_for_multinode
    check_storage_for_multinode("/x/runs", [n for n in ray.nodes() if n["Alive"]], shared=False)
"""

from __future__ import annotations

from typing import Any

from raytrain.config import RaytrainError

# URI schemes that name storage every node reaches (pyarrow filesystems Ray Train writes to).
# file:// is a local path in URI form, so it does not count.
LOCAL_SCHEMES = ("", "file")


def check_storage_for_multinode(storage_path: str, nodes: list[dict[str, Any]],
                                shared: bool) -> None:
    """Refuse a node-local ``--storage-path`` when the cluster spans more than one host.

    Ray Train workers write checkpoints to ``storage_path`` on their own machine and the driver
    reads them (and writes the run files) on its machine: with a local path on several hosts
    each keeps a piece of the run, and resuming or exporting the model fails later. Several
    Ray nodes on one host (``ray start`` twice, ``ray.cluster_utils.Cluster``) share its disk
    and are fine. ``nodes`` is ``ray.nodes()`` (entries marked not ``Alive`` are ignored);
    hosts are told apart by ``NodeManagerAddress``. ``shared=True`` (``--shared-storage``)
    says the local path is an NFS/Lustre/... mount present on every host.

    An autoscaling cluster can grow after this check: on one started by ``ray up`` the head is
    often the only node when a job starts, so point --storage-path at shared storage there.
    """
    scheme = storage_path.split("://", 1)[0].lower() if "://" in storage_path else ""
    if shared or scheme not in LOCAL_SCHEMES:
        return
    alive = [n for n in nodes if n.get("Alive", True)]
    hosts = {n.get("NodeManagerAddress") for n in alive}
    if len(hosts) <= 1:
        return
    raise RaytrainError(
        f"--storage-path {storage_path}: node-local disk, but the workers may run on "
        f"{len(alive)} nodes on {len(hosts)} hosts; use shared storage (an EFS/NFS "
        "mount) or pass --shared-storage if this path is shared")
