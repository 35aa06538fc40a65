"""Every raytrain exception, and the exit code the CLI gives each.

    raytrain: error: --lr: got -1.0; expected a finite number > 0     (exit 2)
"""

from __future__ import annotations

import re
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class RaytrainError(Exception):
    """An error the user can fix; the CLI prints it as one line and exits 2."""


class ConfigError(RaytrainError):
    """A bad setting: names the flag, the value given and what is accepted."""

    def __init__(self, key: str, value: Any, accepted: str, source: str | None = None):
        self.key, self.value, self.accepted = key, value, accepted
        where = f"{key} (in {source})" if source else "--" + key.replace("_", "-")
        super().__init__(f"{where}: got {value!r}; expected {accepted}")
        self.source = source

    def __reduce__(self):  # raised in a Ray worker or trial, it must unpickle on the driver
        return type(self), (self.key, self.value, self.accepted, self.source)


class TrainingError(RaytrainError):
    """Training started but did not finish (exit code 1)."""


class Interrupted(TrainingError):
    """Ctrl-C stopped the run (exit code 130); the checkpoints so far are kept."""


class NoRoom(TrainingError):
    """Raised in the Train controller (driver/nodes.py): after a node was lost the cluster
    had no room for the workers within --wait-timeout. Pickled back to the driver as the
    controller's failure, which words the one line the user sees."""


def exit_code(err: RaytrainError) -> int:
    if isinstance(err, Interrupted):
        return EXIT_INTERRUPTED
    return EXIT_FAILED if isinstance(err, TrainingError) else EXIT_USAGE


def short(err: BaseException) -> str:
    """The gist of a (Ray) error in one short line: its last line, first sentence."""
    text = str(err)
    # The GCS's words for an actor (a Tune trial, a Train worker) on a node that died
    # (gcs_server, Ray 2.60): "The actor died because its node has died. Node Id: <hex>"
    lost = re.search(r"because its node has died\. Node Id: ([0-9a-f]+)", text)
    if lost:
        ip = re.search(r"^\s*ip: (\S+)", text, re.M)
        return f"its node was lost ({ip.group(1) + ', ' if ip else ''}node {lost.group(1)[:12]})"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    last = lines[-1]
    if "worker process has died" in last or "actor died" in last.lower():
        return "a worker process died"
    return last.split(". ")[0][:200]
