"""Reading and writing capture datasets (zarr stores), atomically and with schema checks.

A capture dataset (see :mod:`kverr.dims` for its variables and dims) carries these attrs:

``model_id``, ``weights_sha256``, ``model_dtype``, ``model_n_layers``
    Which model the tensors come from.
``rope``
    JSON object: the model's RoPE parameters plus ``inv_freq`` and ``attention_scaling``
    (enough for :func:`kverr.rope.apply_rope` to map ``k_pre`` to ``k``).
``head_dim``, ``dtype``
    Head dimension and storage dtype (``"float32"`` or ``"float16"``).
``text_source``, ``text_sha256``, ``token_offset``
    Which text, and where in it the token window starts.
``kverr_version``, ``schema_version``, ``torch_version``, ``transformers_version``, ``created_utc``
    Provenance.
``cpu_capability``, ``mkl_cbwr``, ``blas``
    What decided the rounding of the capture's float32 arithmetic
    (:func:`kverr.capturing.float_environment`; absent in captures made before it was recorded).

and the coordinates ``kv_head_of_q`` (q_head), ``sliding_window`` and ``attn_scale`` (layer).
Captures of models with learned attention sinks (gpt-oss) also hold ``attn_sink`` (layer,
q_head), float64: the sink logit of each query head, a softmax column without a value.

Writes go to a temporary store beside the target, which is renamed into place only once it is
complete: a crash or an interrupt never leaves a half-written dataset at the final path (at worst
a ``.NAME.tmp-HOST-PID-RANDOM`` directory beside it, which no reader opens and which the next
write to the same target removes once its process ``PID`` on this host ``HOST`` is gone). Files
(:func:`atomic_write_text`, :func:`atomic_write`) and folders of files (:func:`atomic_dir`, e.g.
exports) are written the same way. :func:`check_output_path` checks an output before any long
work: that it does not exist (or may be replaced), that it is not a directory where a file is
expected, and that its folder is writable. A write that fails anyway (disk full, permissions
changed meanwhile) raises :class:`~kverr.exceptions.OutputError` and leaves nothing behind.

Capture data is read lazily; a chunk that cannot be read or decoded (a damaged or unreadable
store) raises :class:`~kverr.exceptions.CaptureError` naming the capture, whichever computation
reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal

from kverr.dims import CAPTURE_VARS, KV_HEAD_OF_Q, LAYER, Q_HEAD, SCHEMA_VERSION, TOKEN
from kverr.exceptions import CaptureError, KverrError, OutputError, OutputExistsError

log = logging.getLogger(__name__)

__all__ = [
    "REQUIRED_ATTRS",
    "TOKEN_CHUNK",
    "atomic_dir",
    "atomic_write",
    "atomic_write_text",
    "check_finite",
    "check_output_path",
    "clear_stale_temporaries",
    "open_capture",
    "validate_capture",
    "write_dataset",
]

#: Attributes every capture dataset carries.
REQUIRED_ATTRS: tuple[str, ...] = (
    "model_id",
    "weights_sha256",
    "rope",
    "head_dim",
    "dtype",
    "text_source",
    "text_sha256",
    "kverr_version",
    "schema_version",
)

#: Captures longer than this many tokens are also chunked along ``token``.
TOKEN_CHUNK = 2048


def _is_zarr_store(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in ("zarr.json", ".zgroup", ".zattrs"))


def check_output_path(
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    kind: Literal["store", "file", "folder"] = "store",
    own_files: Collection[str] = (),
) -> Path:
    """Check, before any long work, that an output may be written at ``path``; returns it.

    Parameters
    ----------
    path : path-like
        The output.
    overwrite : bool
        An existing output may be replaced.
    kind : {"store", "file", "folder"}
        What is written: a zarr store, a file, or a folder holding the files ``own_files``.
    own_files : collection of str
        For ``kind="folder"``: the names such a folder holds; an existing folder holding
        nothing else is a previous output and may be replaced with ``overwrite``.

    Returns
    -------
    pathlib.Path
        ``path``, with ``~`` expanded.

    Raises
    ------
    OutputExistsError
        ``path`` exists and ``overwrite`` is false, or it exists and is a directory of other
        data (kverr never deletes a directory it did not write).
    OutputError
        ``path`` is a directory where a file is expected, or its folder cannot be written
        (read-only, or a file where a folder is needed).
    """
    target = Path(path).expanduser()
    if kind == "file" and target.is_dir():
        raise OutputError(f"output {target} is a directory; give a file path, e.g. {target / 'NAME'}")
    if target.exists() or target.is_symlink():
        if not overwrite:
            raise OutputExistsError(
                f"output {target} already exists; pass --overwrite (overwrite=True) to replace it"
            )
        if target.is_dir() and not target.is_symlink():
            names = {p.name for p in target.iterdir()}
            if kind == "folder" and not names <= set(own_files):
                raise OutputExistsError(
                    f"output {target} is a directory holding files other than "
                    f"{', '.join(sorted(own_files))}; refusing to replace it even with --overwrite"
                )
            if kind != "folder" and names and not _is_zarr_store(target):
                raise OutputExistsError(
                    f"output {target} is a non-empty directory that is not a zarr store; "
                    "refusing to replace it even with --overwrite"
                )
    _check_writable(target)
    return target


def _check_writable(target: Path) -> None:
    """Raise OutputError unless a file can be created in the folder that will hold ``target``
    (its nearest existing ancestor, when folders are still to be made)."""
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"cannot write {target}: {folder} is a file, not a folder; choose another output path")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-", dir=folder)
    except OSError as exc:
        raise OutputError(
            f"cannot write {target}: the folder {folder} is not writable ({exc.strerror or exc}); "
            "choose another output path or make the folder writable"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temporary_path(target: Path) -> Path:
    """A fresh temporary name beside ``target``: ``.NAME.tmp-HOST-PID-RANDOM``, with this
    process's id and a tag of this host, so that :func:`clear_stale_temporaries` can tell an
    abandoned temporary from one being written."""
    return target.with_name(f".{target.name}.tmp-{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or not a pid we can ask about
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def clear_stale_temporaries(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries of ``target`` that a killed writer left behind.

    Only names of :func:`temporary_path`'s pattern for this very target are considered, and of
    those only the ones made on this host by a process that no longer runs.

    Returns
    -------
    list of pathlib.Path
        What was removed.
    """
    target = Path(target).expanduser()
    pattern = re.compile(rf"\.{re.escape(target.name)}\.tmp-([0-9a-f]{{8}})-([0-9]+)-[0-9a-f]{{32}}")
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    host = _host_tag()
    removed = []
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or m.group(1) != host or _pid_alive(int(m.group(2))):
            continue
        _remove(entry)
        log.info("removed %s, left by a writer (pid %s) that no longer runs", entry, m.group(2))
        removed.append(entry)
    return removed


def _make_folders(folder: Path) -> list[Path]:
    """Make ``folder`` and its missing parents; returns the ones made, innermost first."""
    made = []
    p = folder
    while not (p.exists() or p.is_symlink()) and p != p.parent:
        made.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return made


@contextmanager
def _staged(target: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` (not yet created) for the caller to write;
    rename it to ``target`` when the block ends. On any failure remove it, and the folders
    made for it, and turn an OSError into an OutputError naming ``target``."""
    made: list[Path] = []
    tmp = temporary_path(target)
    try:
        made = _make_folders(target.parent)
        clear_stale_temporaries(target)
        yield tmp
        _replace(tmp, target, overwrite=overwrite)
    except BaseException as exc:
        _remove(tmp)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError) and not isinstance(exc, KverrError):
            raise OutputError(
                f"cannot write {target}: {exc.strerror or exc}; nothing was written. Check the "
                "folder's permissions and free space, or choose another output path"
            ) from exc
        raise


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Write a file by calling ``write(tmp)`` on a temporary path beside ``path``, then
    renaming it to ``path`` (replacing a file there): never half-written.

    Raises
    ------
    OutputError
        The write failed (nothing is left behind).
    """
    target = Path(path).expanduser()
    with _staged(target, overwrite=True) as tmp:
        write(tmp)
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_write`; the file gets the
    permissions a plain ``open`` gives (``0o666`` less the umask)."""

    def write(tmp: Path) -> None:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    return atomic_write(path, write)


@contextmanager
def atomic_dir(
    path: str | os.PathLike[str], *, overwrite: bool = False, own_files: Collection[str] = ()
) -> Iterator[Path]:
    """A folder of files written all or nothing.

    Yields a new empty temporary folder beside ``path``; when the block ends without error it
    is renamed to ``path`` (replacing a previous output there when ``overwrite``); on an error
    it is removed and nothing is left at ``path``.

    Parameters
    ----------
    path : path-like
        The folder to write.
    overwrite : bool
        Replace an existing folder that holds only ``own_files``.
    own_files : collection of str
        The names this kind of folder holds (see :func:`check_output_path`).

    Raises
    ------
    OutputExistsError, OutputError
        As :func:`check_output_path`, or when the write fails.
    """
    target = check_output_path(path, overwrite=overwrite, kind="folder", own_files=own_files)
    with _staged(target, overwrite=overwrite) as tmp:
        tmp.mkdir()
        yield tmp


def _chunks(ds: Any) -> dict[str, int]:
    chunks = {dim: size for dim, size in ds.sizes.items()}
    if LAYER in chunks:
        chunks[LAYER] = 1
    if TOKEN in chunks and chunks[TOKEN] > TOKEN_CHUNK:
        chunks[TOKEN] = TOKEN_CHUNK
    return chunks


def write_dataset(ds: Any, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Write a dataset to a zarr store atomically.

    The dataset is chunked by layer (one layer per chunk) and, beyond :data:`TOKEN_CHUNK`
    tokens, by token. It is written to ``.NAME.tmp-<random>`` beside ``path`` and renamed into
    place when complete; an existing store is replaced only if ``overwrite`` is true.

    Parameters
    ----------
    ds : xarray.Dataset
        Any dataset (numpy- or dask-backed); capture datasets are validated first.
    path : path-like
        Target store.
    overwrite : bool
        Replace an existing store.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    OutputExistsError
        ``path`` exists and ``overwrite`` is false.
    CaptureError
        ``ds`` looks like a capture (has its variables) but breaks the schema.
    """
    target = check_output_path(path, overwrite=overwrite)
    if any(name in ds.variables for name in CAPTURE_VARS):
        validate_capture(ds)
    out = ds.copy(deep=False)
    for var in out.variables.values():
        # Encodings from a store this dataset was read from would fight the new chunks.
        var.encoding = {}
    out = out.chunk(_chunks(out))
    with _staged(target, overwrite=overwrite) as tmp:
        out.to_zarr(tmp, mode="w-", consolidated=False)
    log.info("wrote %s", target)
    return target


def _replace(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """Rename a complete ``tmp`` to ``target``, moving an existing target aside first."""
    if not (target.exists() or target.is_symlink()):
        try:
            os.rename(tmp, target)
            return
        except OSError:
            if not target.exists():
                raise
            # Something appeared at the target meanwhile; treat it as an existing output.
    if not overwrite:
        raise OutputExistsError(f"output {target} appeared while writing; not replacing it")
    if not tmp.is_dir() and not target.is_dir():
        os.replace(tmp, target)  # a file replaces a file atomically
        return
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)  # the previous output stays where it was
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


def validate_capture(ds: Any, *, where: str = "the dataset") -> None:
    """Check that a dataset follows the capture schema of this kverr version.

    Raises
    ------
    CaptureError
        Naming the first thing that is wrong: schema version, a missing attribute, variable or
        coordinate, a variable with the wrong dims, or no tokens at all.
    """
    version = ds.attrs.get("schema_version")
    if version is None:
        raise CaptureError(f"{where} is not a kverr capture (no schema_version attribute)")
    if int(version) != SCHEMA_VERSION:
        raise CaptureError(
            f"{where} has capture schema version {version}; this kverr reads version "
            f"{SCHEMA_VERSION}: capture again with this kverr"
        )
    missing_attrs = [a for a in REQUIRED_ATTRS if a not in ds.attrs]
    if missing_attrs:
        raise CaptureError(f"{where} lacks the attributes {missing_attrs}")
    for name, dims in CAPTURE_VARS.items():
        if name not in ds.data_vars:
            raise CaptureError(f"{where} lacks the variable {name!r} (dims {dims})")
        if tuple(ds[name].dims) != dims:
            raise CaptureError(
                f"variable {name!r} in {where} has dims {tuple(ds[name].dims)}, expected {dims}"
            )
    if ds.sizes.get(TOKEN, 0) == 0:
        raise CaptureError(f"{where} holds no tokens; capture at least one (kverr capture --tokens N)")
    if KV_HEAD_OF_Q not in ds.coords or tuple(ds[KV_HEAD_OF_Q].dims) != (Q_HEAD,):
        raise CaptureError(f"{where} lacks the coordinate {KV_HEAD_OF_Q!r} on {Q_HEAD!r}")
    if int(ds.attrs["head_dim"]) != ds.sizes.get("channel"):
        raise CaptureError(
            f"{where}: head_dim attribute {ds.attrs['head_dim']} != {ds.sizes.get('channel')} channels"
        )
    try:
        json.loads(ds.attrs["rope"])
    except (TypeError, ValueError) as exc:
        raise CaptureError(f"{where}: the rope attribute is not a JSON object: {exc}") from exc


def open_capture(path: str | os.PathLike[str]) -> Any:
    """Open a capture lazily (dask-backed, one chunk per layer) and check its schema.

    Parameters
    ----------
    path : path-like
        A store written by :func:`write_dataset` (e.g. by ``kverr capture``).

    Returns
    -------
    xarray.Dataset
        Dask-backed; nothing is read until computed.

    Raises
    ------
    CaptureError
        The path is missing, not a zarr store, or not a capture of this schema version.
    """
    import xarray as xr

    import kverr.accessor  # noqa: F401  (registers ds.kv on the dataset returned)

    src = Path(path).expanduser()
    try:
        if not src.exists():
            raise CaptureError(f"no capture at {src}; make one with `kverr capture --out {src}`")
        if not _is_zarr_store(src):
            raise CaptureError(f"{src} is not a zarr store (no zarr.json / .zgroup in it)")
        # Every chunk is read through _read_chunk, so that a damaged store fails with one clear
        # error in whichever computation first reads it.
        read = {"getitem": partial(_read_chunk, source=str(src))}
        _quiet_abandoned_zarr_tasks()
        ds = xr.open_zarr(src, chunks={}, consolidated=False, from_array_kwargs=read)
    except CaptureError:
        raise
    except OSError as exc:
        raise _unreadable(src, exc) from None
    except Exception as exc:  # zarr raises a variety of errors on damaged stores
        raise CaptureError(f"cannot open {src} as a zarr dataset: {exc}") from None
    validate_capture(ds, where=str(src))
    return ds


class _AbandonedZarrTasks(logging.Filter):
    """Drops asyncio's reports of zarr's own abandoned tasks.

    When one of zarr's concurrent metadata reads fails (a damaged ``zarr.json``), zarr raises
    that error and abandons its sibling tasks; asyncio later reports each of them, failed
    ("exception was never retrieved", with the same error's traceback) or still pending at
    exit ("destroyed but it is pending"). The error that matters has already become a
    CaptureError.
    """

    REPORTS = ("Task exception was never retrieved", "Future exception was never retrieved",
               "Task was destroyed but it is pending")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith(self.REPORTS) and "zarr" in msg)


_ZARR_TASK_FILTER = _AbandonedZarrTasks()


def _quiet_abandoned_zarr_tasks() -> None:
    asyncio_log = logging.getLogger("asyncio")
    if _ZARR_TASK_FILTER not in asyncio_log.filters:
        asyncio_log.addFilter(_ZARR_TASK_FILTER)


def _unreadable(src: Path | str, exc: OSError) -> CaptureError:
    return CaptureError(
        f"cannot read the capture {src}: {exc.strerror or exc}; check that it is readable by you"
    )


def _read_chunk(array: Any, index: Any, asarray: bool = True, lock: Any = None, *, source: str) -> Any:
    """dask's chunk getter, with read and decode failures turned into a CaptureError."""
    from dask.array.core import getter

    try:
        return getter(array, index, asarray=asarray, lock=lock)
    except (KverrError, MemoryError):
        raise
    except OSError as exc:
        raise _unreadable(source, exc) from None
    except Exception as exc:  # codecs raise RuntimeError, ValueError, ... on damaged chunks
        raise CaptureError(
            f"the capture {source} is damaged: a chunk cannot be read ({type(exc).__name__}: {exc}); "
            "capture it again (kverr capture --overwrite)"
        ) from None



def check_finite(ds: Any, names: tuple[str, ...] = ("q", "k_pre", "k", "v")) -> None:
    """Refuse a capture whose tensors hold NaN or Inf, naming where.

    One pass over the data (dask, chunk by chunk); cheap beside any analysis of it, and much
    clearer than the error a NaN causes several stages later.

    Parameters
    ----------
    ds : xarray.Dataset
        A capture (or a selection of one).
    names : tuple of str
        Variables to check; those the dataset lacks are skipped.

    Raises
    ------
    kverr.exceptions.NonFiniteError
        Naming the variable, how many values are not finite, and the coordinates of the first
        one: layer (its index in the model), head, token and channel.
    """
    import numpy as np

    from kverr.exceptions import NonFiniteError

    for name in names:
        if name not in ds.data_vars:
            continue
        da = ds[name]
        inner = [d for d in da.dims if d not in (LAYER, "kv_head", Q_HEAD)]
        counts = np.asarray((~np.isfinite(da)).sum(inner).values)
        if not counts.any():
            continue
        where = np.argwhere(counts)[0]
        outer = {d: int(i) for d, i in zip([d for d in da.dims if d not in inner], where)}
        block = np.asarray(da.isel(outer).values)
        first = dict(zip(inner, (int(i) for i in np.argwhere(~np.isfinite(block))[0])))
        coords = {**outer, **first}
        if LAYER in coords:
            coords[LAYER] = int(ds[LAYER].values[coords[LAYER]])
        at = ", ".join(f"{d} {coords[d]}" for d in da.dims)
        raise NonFiniteError(
            f"the capture's {name!r} holds {int(counts.sum())} NaN/Inf value(s), the first at {at}; "
            "kverr needs finite keys, values and queries: capture again (with --dtype float32 if "
            "float16 overflowed)"
        )
