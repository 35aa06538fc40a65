"""The Tune layer: many trainings searching lr and batch size, weak ones stopped early.

    python -m raytrain.fit --tune --num-samples 8 --num-workers 1 --dataset digits --epochs 10

``search``: the driver side (space, schedulers, Tuner, progress); ``trial``: one trial;
``asha``: ASHA with a late check; ``pbt``: PBT's starts and reports; ``placement``: the
placement-group reaper; ``results``: results.csv, plot, summary.
"""

from raytrain.tune.asha import LateCheckASHA, fell_behind  # noqa: F401
from raytrain.tune.pbt import StartFrom, retarget  # noqa: F401
from raytrain.tune.placement import PG_FILE, PlacementGroupReaper, RecordPlacementGroup  # noqa
from raytrain.tune.results import (TuneSummary, print_summary, read_results,  # noqa: F401
                                   summary_text)
from raytrain.tune.search import (check, placeable_trials, run, scheduler,  # noqa: F401
                                  search_space, tune_config)
