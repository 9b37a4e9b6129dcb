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

and the coordinates ``kv_head_of_q`` (q_head), ``sliding_window`` and ``attn_scale`` (layer).

Writes go to a temporary store beside the target, which is renamed into place only once it is
complete: a crash or an interrupt never leaves a half-written dataset at the final path (at worst
a ``.NAME.tmp-*`` directory beside it, which no reader opens).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from kverr.dims import CAPTURE_VARS, KV_HEAD_OF_Q, LAYER, Q_HEAD, SCHEMA_VERSION, TOKEN
from kverr.errors import CaptureError, OutputExistsError

log = logging.getLogger(__name__)

__all__ = [
    "REQUIRED_ATTRS",
    "TOKEN_CHUNK",
    "check_output_path",
    "open_capture",
    "rope_params",
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


def check_output_path(path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Check that a dataset may be written at ``path``; returns it as a Path.

    Raises
    ------
    OutputExistsError
        ``path`` exists and ``overwrite`` is false, or it exists and is something other than a
        zarr store, an empty directory or a file (kverr never deletes a directory of other data).
    """
    target = Path(path).expanduser()
    if not target.exists() and not target.is_symlink():
        return target
    if not overwrite:
        raise OutputExistsError(
            f"output {target} already exists; pass --overwrite (overwrite=True) to replace it"
        )
    if target.is_dir() and not _is_zarr_store(target) and any(target.iterdir()):
        raise OutputExistsError(
            f"output {target} is a non-empty directory that is not a zarr store; "
            "refusing to replace it even with --overwrite"
        )
    return target


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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
    out = ds.copy(deep=False)
    for var in out.variables.values():
        # Encodings from a store this dataset was read from would fight the new chunks.
        var.encoding = {}
    out = out.chunk(_chunks(out))
    try:
        out.to_zarr(tmp, mode="w-", consolidated=False)
        _replace(tmp, target, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
    os.rename(target, old)
    os.rename(tmp, target)
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
        coordinate, or a variable with the wrong dims.
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

    src = Path(path).expanduser()
    if not src.exists():
        raise CaptureError(f"no capture at {src}; make one with `kverr capture --out {src}`")
    if not _is_zarr_store(src):
        raise CaptureError(f"{src} is not a zarr store (no zarr.json / .zgroup in it)")
    try:
        ds = xr.open_zarr(src, chunks={}, consolidated=False)
    except Exception as exc:  # zarr raises a variety of errors on damaged stores
        raise CaptureError(f"cannot open {src} as a zarr dataset: {exc}") from exc
    validate_capture(ds, where=str(src))
    return ds


def rope_params(ds: Any) -> dict[str, Any]:
    """The RoPE parameters of a capture, decoded from its ``rope`` JSON attribute."""
    return dict(json.loads(ds.attrs["rope"]))
