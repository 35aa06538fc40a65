"""Run files on disk: one atomic write, one JSONL appender, JSONL and CSV readers/writers, and
why a torch file (checkpoint, weights) will not load.

Every writer leaves a file whole or as it was: on a full disk the old content stays.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import zipfile
from typing import Any, Iterable, Iterator, Sequence

# A run directory's files that more than one side writes or reads.
EVENTS_FILE = "events.jsonl"  # progress lines and failures: workers/controller write, driver prints
METRICS_FILE = "metrics.jsonl"  # one row per epoch, written by the controller's RunFiles
STATE_FILE = "state.pt"  # a checkpoint's training state (raytrain.checkpoint reads and writes it)
MODEL_FILE = "model.pt"  # the weights alone: a run's export, and its last checkpoint's (rank 0)


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
    """``with replacing(path) as tmp:`` write ``tmp``; on success it replaces ``path`` whole,
    on any failure it is removed and ``path`` stays as it was."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write(path: str, data: str | bytes) -> None:
    """Replace ``path`` whole or not at all (temp file beside it, then rename)."""
    with replacing(path) as tmp, open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_jsonl(path: str, row: dict[str, Any]) -> None:
    """Append one line, or nothing: a write cut short (full disk) is truncated away, never
    more than that (the lines before it stay)."""
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def jsonl_text(rows: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def csv_text(columns: Sequence[str], rows: Iterable[dict[str, Any]]) -> str:
    """A CSV (quoted where needed by the csv module); keys not in ``columns`` are left out."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_csv(path: str, columns: Sequence[str], rows: Iterable[dict[str, Any]]) -> None:
    atomic_write(path, csv_text(columns, rows))


def read_csv(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def why_unloadable(path: str, err: Exception) -> str:
    """Why ``torch.load(path, weights_only=True)`` raised ``err``, in words."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    zipped = zipfile.is_zipfile(path)
    if _starts_with(path, b"PK\x03\x04") and not zipped:
        return "it is truncated (torch.save's zip is incomplete)"
    if ("weights_only" in str(err) or "Unsupported global" in str(err)) and (
            zipped or _starts_with(path, b"\x80")):  # a pickle (protocol 2+)
        return "it holds Python objects other than tensors (refused, nothing was run)"
    return f"not a file torch.save wrote ({type(err).__name__}: {first[:80]})".replace(": )", ")")


def _starts_with(path: str, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic
