"""Run directories on a local path or in a bucket (``s3://``, ``gs://``), through pyarrow's
file systems, the ones Ray Train writes checkpoints with.

A run on a bucket keeps raytrain's own run files (config.yaml, metrics, events, TensorBoard,
plots, model.pt) in a local mirror on the driver, ``~/.cache/raytrain/runs/<scheme>/<bucket>/
<prefix>/<name>`` ($RAYTRAIN_CACHE instead of ~/.cache/raytrain), and uploads each file after
it changes: an object is replaced whole or not at all. Before a run starts or is checked, the
mirror is emptied and the run's small files are downloaded from the bucket (the bucket is the
truth: a run can be resumed from any machine). Checkpoints never pass through the mirror: Ray
Train's storage writes them to the bucket. Credentials: pyarrow's standard chains only
(AWS_* variables, ~/.aws, the instance profile; GOOGLE_APPLICATION_CREDENTIALS, the VM's
service account); the endpoint of an S3-compatible server from AWS_ENDPOINT_URL.

    storage.is_uri("s3://bucket/runs")             # True
    storage.upload(local_dir, "s3://bucket/runs/x", ["metrics.jsonl", "tensorboard"])
"""

from __future__ import annotations

import os
import posixpath
import shutil
import zipfile

from raytrain.errors import ConfigError

# Schemes accepted by --storage-path (pyarrow file systems Ray Train also writes to).
SCHEMES = ("s3", "gs", "gcs")
# The run files a check or a resume needs, downloaded into the mirror before it runs.
SMALL_FILES = ("config.yaml", "metrics.jsonl", "metrics.csv", "events.jsonl", "classes.json",
               "mlflow_run_id")  # driver/tracking.py RUN_ID_FILE: a resumed run continues it


class UploadError(OSError):
    """A run file could not be copied to the bucket; the message names it and where."""


def scheme(location: str) -> str:
    return location.split("://", 1)[0].lower() if "://" in location else ""


def is_uri(location: str) -> bool:
    """True for a bucket URI; a local path (or file://) is not one."""
    return scheme(location) not in ("", "file")


def join(location: str, *parts: str) -> str:
    return posixpath.join(location, *parts) if is_uri(location) else os.path.join(location, *parts)


def resolve_fs(location: str, flag: str = "storage_path"):
    """(pyarrow filesystem, path inside it) for a local path or a bucket URI; a URI pyarrow
    cannot open is one ConfigError naming ``flag``."""
    import pyarrow.fs as pafs

    if "://" in location:
        try:
            fs, path = pafs.FileSystem.from_uri(location)
        except Exception as err:
            raise ConfigError(flag, location, f"a local path or an s3:// or gs:// URI "
                              f"pyarrow can open ({type(err).__name__}: {str(err)[:100]})"
                              ) from None
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(location)


def cache_root() -> str:
    return os.environ.get("RAYTRAIN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "raytrain")


def mirror_of(uri: str) -> str:
    """The driver's local copy of the run files of the run at ``uri``."""
    rest = uri.split("://", 1)[1].strip("/")
    return os.path.join(cache_root(), "runs", scheme(uri), *[p for p in rest.split("/") if p])


def local_dir(location: str) -> str:
    """Where the run files of ``location`` are on this machine: the path itself, or for a
    bucket URI this machine's mirror of it."""
    return mirror_of(location) if is_uri(location) else location


# ---------------------------------------------------------------------------- reading


def exists(location: str) -> bool:
    import pyarrow.fs as pafs

    fs, path = resolve_fs(location)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(location: str) -> bytes | None:
    """The file's content; None when there is none."""
    import pyarrow.fs as pafs

    fs, path = resolve_fs(location)
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return f.read()


def listdir(location: str) -> list[str]:
    """Names of the entries directly in ``location`` ([] when it does not exist)."""
    import pyarrow.fs as pafs

    fs, path = resolve_fs(location)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)


def is_zip(location: str) -> bool:
    """A whole torch.save file (a zip: its directory is written last)."""
    import pyarrow.fs as pafs

    fs, path = resolve_fs(location)
    if fs.get_file_info(path).type != pafs.FileType.File:
        return False
    with fs.open_input_file(path) as f:
        return zipfile.is_zipfile(f)


# ---------------------------------------------------------------------------- writing


def delete_dir(location: str) -> None:
    """Delete ``location`` and everything under it (nothing when it does not exist)."""
    import pyarrow.fs as pafs

    fs, path = resolve_fs(location)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


def check_writable(uri: str) -> None:
    """Write and delete one small object under ``uri`` (OSError when the bucket refuses)."""
    fs, path = resolve_fs(uri)
    probe = f"{path}/.raytrain-write-test-{os.getpid()}"
    with fs.open_output_stream(probe) as f:
        f.write(b"")
    fs.delete_file(probe)


def upload(local_dir: str, uri: str, names: list[str] | tuple[str, ...]) -> None:
    """Copy each of ``names`` (files or directories, relative to ``local_dir``) that exists
    there to the same place under ``uri``. An UploadError names the first that failed."""
    import pyarrow.fs as pafs

    fs, root = resolve_fs(uri)
    local = pafs.LocalFileSystem()
    for name in names:
        src = os.path.join(local_dir, name)
        if not os.path.exists(src):
            continue
        try:
            if os.path.isdir(src):
                pafs.copy_files(src, f"{root}/{name}", source_filesystem=local,
                                destination_filesystem=fs)
            else:
                with open(src, "rb") as f, fs.open_output_stream(f"{root}/{name}") as out:
                    out.write(f.read())
        except OSError as err:
            raise UploadError(f"uploading {name} to {join(uri, name)} failed: "
                              f"{first_line(err)}") from None


def download(uri: str, local_dir: str, names: tuple[str, ...] = SMALL_FILES) -> None:
    """Copy each of ``names`` (files) that exists under ``uri`` into ``local_dir``."""
    os.makedirs(local_dir, exist_ok=True)
    for name in names:
        data = read_bytes(join(uri, name))
        if data is not None:
            with open(os.path.join(local_dir, name), "wb") as f:
                f.write(data)


def pull_newer(uri: str, local_dir: str, names: tuple[str, ...]) -> list[str]:
    """Download each of ``names`` (files) under ``uri`` into ``local_dir``, except where the
    local copy is ahead: the bucket has none, or the local one extends it (an append-only file
    written here after its last upload, e.g. by a process stopped between the two). Returns
    those names, for the caller to upload."""
    os.makedirs(local_dir, exist_ok=True)
    ahead = []
    for name in names:
        path = os.path.join(local_dir, name)
        remote = read_bytes(join(uri, name))
        local = None
        if os.path.isfile(path):
            with open(path, "rb") as f:
                local = f.read()
        if local is not None and (remote is None or (local != remote
                                                      and local.startswith(remote))):
            ahead.append(name)
        elif remote is not None:
            with open(path, "wb") as f:
                f.write(remote)
    return ahead


def pull(uri: str, mirror: str) -> None:
    """Make ``mirror`` hold exactly the run's small files as the bucket has them."""
    shutil.rmtree(mirror, ignore_errors=True)
    download(uri, mirror)


def fetch_tree(uri: str, into: str) -> str:
    """Copy the file or directory at ``uri`` (one level: a checkpoint or run directory's
    files, not its subdirectories) and the config.yaml of the two directories above it into
    ``into``, keeping their layout; returns the local path standing for ``uri``."""
    import pyarrow.fs as pafs

    fs, path = resolve_fs(uri)
    parts = path.strip("/").split("/")
    local = os.path.join(into, *parts)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        names = [n for n in listdir(uri)
                 if fs.get_file_info(f"{path}/{n}").type == pafs.FileType.File]
        download(uri, local, tuple(names))
    elif info.type == pafs.FileType.File:
        download(posixpath.dirname(uri.rstrip("/")), os.path.dirname(local), (parts[-1],))
    for up in (1, 2):
        if len(parts) > up:
            parent = "/".join(parts[:-up])
            download(f"{scheme(uri)}://{parent}", os.path.join(into, *parts[:-up]),
                     ("config.yaml",))
    return local


def first_line(err: BaseException) -> str:
    """The reason in ``err``, one line. pyarrow's S3 errors start "When <doing> key 'k' in
    bucket 'b': AWS Error <KIND> during <Op>: ..."; the part from "AWS Error" is the reason."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if isinstance(err, UploadError):  # made of a first_line already
        return text
    if "AWS Error" in text:
        text = text[text.index("AWS Error"):].split("; Details:")[0]
    return text[:200]
