"""The predictions file: rows streamed into one Parquet or CSV file (by --out's extension),
written to a temporary file and only then made the output: beside a local --out and renamed
over it, or on local disk and uploaded (one object, whole or not at all) for a bucket --out.
A killed run leaves no file that looks complete.

    check_writable("preds.parquet")          # before Ray starts: one line, exit 2
    with Output("s3://b/preds.csv", top_k=5) as out:
        out.write(table)                     # pa.Table with SCHEMA's columns
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from raytrain import storage
from raytrain.errors import ConfigError

FORMATS = (".parquet", ".csv")


def schema(top_k: int):
    """path, class (name), label (index), prob; the top-k lists with --top-k > 1; error
    (empty, or why that file could not be read). class/label/prob are null on error rows."""
    import pyarrow as pa

    fields = [("path", pa.string()), ("class", pa.string()), ("label", pa.int64()),
              ("prob", pa.float32())]
    if top_k > 1:
        fields += [("topk_class", pa.list_(pa.string())), ("topk_prob", pa.list_(pa.float32()))]
    return pa.schema(fields + [("error", pa.string())])


def fmt_of(out: str) -> str:
    ext = os.path.splitext(out.rstrip("/"))[1].lower()
    if ext not in FORMATS:
        raise ConfigError("out", out, "a file name ending in .parquet or .csv (local or s3:// "
                          "/ gs://)")
    return ext


def check_writable(out: str) -> None:
    """--out can be written: its extension, and its directory (created if missing), probed with
    a file that is removed again; a bucket prefix with one small object."""
    fmt_of(out)
    if storage.is_uri(out):
        import posixpath

        try:
            storage.check_writable(posixpath.dirname(out.rstrip("/")))
        except (OSError, ConfigError) as err:
            raise ConfigError("out", out, f"a location these credentials can write "
                              f"({storage.first_line(err)})") from None
        return
    if os.path.isdir(out):
        raise ConfigError("out", out, "a file path (it is a directory)")
    parent = os.path.dirname(os.path.abspath(out))
    probe = os.path.join(parent, f".{os.path.basename(out)}.probe{os.getpid()}")
    try:
        os.makedirs(parent, exist_ok=True)
        open(probe, "wb").close()
        os.remove(probe)
    except OSError as err:
        raise ConfigError("out", out, f"a path that can be written ({err.strerror or err})"
                          ) from None


class Output:
    """``write(table)`` appends rows; leaving the ``with`` block normally publishes the file,
    an exception (Ctrl-C included) removes the temporary one and leaves --out as it was."""

    def __init__(self, out: str, top_k: int):
        self.out, self.fmt, self.schema = out, fmt_of(out), schema(top_k)
        self.rows = 0
        if storage.is_uri(out):
            self.tmpdir = tempfile.mkdtemp(prefix="raytrain-predict-")
            self.tmp = os.path.join(self.tmpdir, "out" + self.fmt)
        else:
            self.tmpdir = None
            self.tmp = f"{os.path.abspath(out)}.tmp{os.getpid()}"
        self.writer = None

    def __enter__(self) -> "Output":
        import pyarrow.csv as pcsv
        import pyarrow.parquet as pq

        if self.fmt == ".parquet":
            self.writer = pq.ParquetWriter(self.tmp, self.schema)
        else:
            self.writer = pcsv.CSVWriter(self.tmp, self._csv_schema())
        return self

    def _csv_schema(self):
        import pyarrow as pa

        return pa.schema([pa.field(f.name, pa.string()) if pa.types.is_list(f.type) else f
                          for f in self.schema])

    def write(self, table) -> None:
        table = table.select(self.schema.names).cast(self.schema)
        if self.fmt == ".csv":
            table = _lists_as_json(table)
        self.writer.write_table(table)
        self.rows += table.num_rows

    def __exit__(self, kind, err, tb) -> None:
        try:
            self.writer.close()
            if kind is None:
                self._publish()
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)
            if self.tmpdir:
                shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _publish(self) -> None:
        if self.tmpdir is None:
            os.replace(self.tmp, self.out)
            return
        fs, path = storage.resolve_fs(self.out, "out")
        # An S3 object appears only when the (multipart) upload completes: whole or not at all.
        with open(self.tmp, "rb") as src, fs.open_output_stream(path) as dst:
            shutil.copyfileobj(src, dst, 8 * 2**20)


def _lists_as_json(table):
    """CSV has no list type: the top-k lists as JSON arrays (``["3", "8"]``, ``[0.9, 0.1]``)."""
    import pyarrow as pa

    for i, f in enumerate(table.schema):
        if pa.types.is_list(f.type):
            values = [None if v is None else json.dumps(
                [round(x, 6) if isinstance(x, float) else x for x in v])
                for v in table.column(i).to_pylist()]
            table = table.set_column(i, f.name, pa.array(values, pa.string()))
    return table
