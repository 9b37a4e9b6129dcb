"""What every engine export shares: the format a config gives each (layer, kv head, K|V),
refusals that list what a target cannot express, and folders written all or nothing
(:func:`kverr.io.atomic_dir`: into a temporary folder beside ``out``, renamed to ``out`` once every
file is complete, so a refusal or a failure leaves no folder behind; an existing ``out`` is
replaced only with ``overwrite`` and only when it holds nothing but an export's own files)."""

from __future__ import annotations

from pathlib import Path

from kverr.config import WHICH, CacheConfig
from kverr.exceptions import ConfigError
from kverr.io import atomic_dir
from kverr.quant.formats import QuantFormat


def formats_of(config: CacheConfig, n_layers: int, n_kv: int) -> dict[tuple[int, int, str], QuantFormat]:
    return {(l, h, w): config.format_for(l, h, w) for l in range(n_layers) for h in range(n_kv) for w in WHICH}


def refuse(target: str, problems: list[str], hint: str = "") -> None:
    """Raise ConfigError listing (up to six of) ``problems``, then ``hint``; nothing if none."""
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise ConfigError(f"{target} cannot express this config: " + "; ".join(problems[:6]) + more
                          + (f". {hint}" if hint else ""))


def shape_of(config: CacheConfig, n_layers: int | None, n_kv: int | None) -> tuple[int, int]:
    if n_layers is None or n_kv is None:
        n_layers = max([*config.layers, *(l for l, _ in config.heads), -1]) + 1 if n_layers is None else n_layers
        n_kv = max([*(h for _, h in config.heads), -1]) + 1 if n_kv is None else n_kv
    return max(1, n_layers), max(1, n_kv)


def common_refusals(config: CacheConfig, target: str) -> list[str]:
    p = []
    if config.sinks:
        p.append(f"sinks={config.sinks} full-precision sink tokens ({target} keeps none)")
    if config.key_pre_rope:
        p.append(f"key_pre_rope=true ({target} stores keys after RoPE)")
    if config.salient:
        p.append(f"salient={config.salient} salient prompt tokens per head ({target} keeps none)")
    if config.compensates_keys:
        p.append(f"key_rounding={config.key_rounding} ({target} rounds keys to nearest)")
    if config.windows_vary:
        p.append(f"a window length per layer or kv head, up to {config.max_window()} tokens ({target} keeps one "
                 "for the whole model, if any)")
    if config.window_dtype == "int8":
        p.append(f"window_dtype=int8 ({target} keeps the tokens it does not quantize in the model's dtype)")
    return p


def uniform(fmts: dict, target: str) -> tuple[QuantFormat, QuantFormat, list[str]]:
    p = []
    by = {w: sorted({f for (_, _, ww), f in fmts.items() if ww == w}, key=lambda f: f.label()) for w in WHICH}
    for w in WHICH:
        if len(by[w]) > 1:
            where = [f"{l}:{h}" for (l, h, ww), f in sorted(fmts.items()) if ww == w and f != by[w][0]]
            p.append(
                f"{'keys' if w == 'k' else 'values'} use {len(by[w])} formats "
                f"({', '.join(f.label() for f in by[w][:4])}; e.g. heads {', '.join(where[:3])}); "
                f"{target} uses one format for the whole model"
            )
    return by["k"][0], by["v"][0], p


def write_folder(out: Path, texts: dict[str, str], *, overwrite: bool, own_files: tuple[str, ...]) -> list[Path]:
    """Write the text files ``texts`` (name -> content) into the folder ``out``, all or nothing."""
    with atomic_dir(out, overwrite=overwrite, own_files=own_files) as tmp:
        for name, text in texts.items():
            (tmp / name).write_text(text, encoding="utf-8")
    return [out / name for name in texts]
