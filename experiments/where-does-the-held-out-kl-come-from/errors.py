"""Quantization error of the prompt's tokens against the decode tokens' under a config.

Runs one segment through the config (``kverr evaluate``'s protocol: the prompt quantized whole after
the prefill, then teacher-forced decode steps) and records, over the blocks the cache quantizes,
per (layer, K|V, prompt or decode block): the relative squared error ``|x - x^|^2 / |x|^2`` of its tokens and the fraction
of elements of static-scale formats that fall outside the grid's range (clamped). Blocks that start
in the prompt are the prompt's; the later ones are decode tokens leaving the window.

Usage (from the repository root): PYTHONPATH=. python experiments/where-does-the-held-out-kl-come-from/errors.py
    CONFIG OUT.csv [--segments 0]
"""
from __future__ import annotations

import pandas as pd
import torch

from bench.heldout import protocol_parser, protocol_segments
from kverr.capturing import load_model
from kverr.config import CacheConfig
from kverr.evaluation import teacher_forced
from kverr.hf import KverrCache
from kverr.hf.reference import KverrLayer
from kverr.quant.formats import is_static
from kverr.quant.reference import hadamard_rotate

ROWS: list[dict] = []
_quantize = KverrLayer._quantize


def quantize(self, which, g, x):
    qt = _quantize(self, which, g, x)
    xr = hadamard_rotate(x.float()) if g.fmt.rotate == "hadamard" else x.float()
    y = qt.dequantize(unrotate=False)
    row = {"layer": self.layer_idx, "side": which, "start": g.n_sinks + g.n_quantized, "tokens": x.shape[2],
           "format": g.fmt.label(), "err": float(((xr - y) ** 2).sum()), "norm": float((xr ** 2).sum()),
           "clamped": float("nan")}
    if not g.fmt.is_float and is_static(g.fmt.granularity) and g.fmt.dtype == "int" and g.fmt.has_zero:
        s, m = qt.element_metadata()
        bits = torch.tensor(g.fmt.channel_bits if g.fmt.channel_bits is not None else [g.fmt.bits] * x.shape[-1])
        top = m + s * (2 ** bits - 1).clamp(min=0)
        live = (bits > 0).expand_as(xr)
        out = ((xr < m - s / 2) | (xr > top + s / 2)) & live
        row["clamped"] = float(out.sum()) / max(1, int(live.sum()))
    ROWS.append(row)
    return qt


KverrLayer._quantize = quantize


@torch.no_grad()
def main(argv=None) -> int:
    a = protocol_parser(__doc__).parse_args(argv)
    if len(a.segments) != 1:
        raise SystemExit("errors.py runs one segment")
    torch.set_num_threads(a.threads)
    loaded = load_model("default")
    cfg = CacheConfig.load(a.config)
    [(p, seg, off, ids)] = protocol_segments(loaded, a.segments)
    teacher_forced(loaded.model, KverrCache.for_model(loaded.model, cfg), ids, p, flush=True)
    df = pd.DataFrame(ROWS)
    df["block"] = (df["start"] < p).map({True: "prompt", False: "decode"})
    g = df.groupby(["layer", "side", "block"])
    pd.DataFrame({"relative_squared_error": g.err.sum() / g.norm.sum(), "clamped_fraction": g.clamped.mean(),
                  "tokens": g.tokens.sum()}).reset_index().to_csv(a.out, index=False, float_format="%.5g")
    g = df.groupby(["side", "block"])
    print((g.err.sum() / g.norm.sum()).rename("relative squared error").to_string())
    print(g.clamped.mean().rename("clamped fraction (static formats)").to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
