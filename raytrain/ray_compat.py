"""The TorchTrainer raytrain runs: Ray Train's own, less the processes raytrain has no use for.

On a small machine every Ray process costs seconds before the first training step: each one
imports Ray (and most of them more) on the same cores the workers need. Beside its controller
and workers, Ray Train 2.60 starts for every run:

- a Ray Data ``DatasetManager`` actor, even when the trainer is given no Ray Datasets.
  raytrain never passes any (each worker keeps its shard as a tensor, ``data.py``): dropped.
- Ray Data's autoscaling coordinator, which the fixed scaling policy asks for the workers'
  resources. On a cluster that cannot grow there is nothing to ask for; on one that can,
  raytrain keeps it (and asks the autoscaler itself first, ``launch.preflight``): dropped only
  where ``preflight`` found no autoscaling node types.
- a detached ``PlacementGroupCleaner`` that removes the workers' placement group if the
  controller dies while the driver lives on. In a plain run the driver exits right after the
  controller, and Ray frees a finished job's placement groups: dropped there, kept in Tune
  trials, whose driver outlives them.

Measured on 2 cores (``benchmarks/launcher_overhead.py``): see the README's results table.
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer


class _Absent:
    """Stands for an internal class another Ray version does not have: nothing is dropped."""


try:  # Ray Train 2.60 internals
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import \
        PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy
except ImportError:
    DatasetsCallback = PlacementGroupCleanerCallback = FixedScalingPolicy = _Absent


class Trainer(TorchTrainer):
    """``TorchTrainer`` without the actors above. ``fixed_cluster``: the cluster cannot grow;
    ``driver_outlives_run``: keep the placement-group cleaner (Tune trials)."""

    def __init__(self, *args, fixed_cluster: bool, driver_outlives_run: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.fixed_cluster = fixed_cluster
        self.driver_outlives_run = driver_outlives_run

    def _create_default_callbacks(self):
        drop: tuple[type, ...] = () if self.datasets else (DatasetsCallback,)
        if not self.driver_outlives_run:
            drop += (PlacementGroupCleanerCallback,)
        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, drop)]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if self.fixed_cluster and type(controller_init_kwargs.get("scaling_policy")) is \
                FixedScalingPolicy:
            controller_init_kwargs["scaling_policy"] = FixedClusterPolicy(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


class FixedClusterPolicy(FixedScalingPolicy):
    """Ray's fixed scaling policy, minus its resource requests to the autoscaling coordinator
    (whose actor it would start): a cluster that cannot grow has nobody to answer them."""

    def after_controller_start(self, train_run_context) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass

    def _cancel_resource_request(self) -> None:
        pass
