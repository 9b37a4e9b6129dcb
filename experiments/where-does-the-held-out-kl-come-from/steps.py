"""Per decode step KL of a config held out, and of three variants that each remove one source of
error, to say where the held-out KL of a calibrated config comes from.

Per segment (the README's protocol: typing.py, P = 1024 prompt tokens quantized whole after the
prefill, N = 256 teacher-forced decode steps), the reference run, then:

* ``config``: the config as is (what ``kverr evaluate`` measures);
* ``keys``: its keys only (values fp16 everywhere);
* ``values``: its values only (keys fp16 everywhere);
* ``prompt``: as is, but no decode token is ever quantized (they stay the int8 rows the window
  holds): the error of the quantized prompt alone;
* ``fitall``: as is, but static scales are fitted on all the prompt tokens the cache quantizes,
  the salient ones included (the cache leaves them out);
* ``tier4``, ``tier3``: as is, but the decode tokens that leave the window are quantized as int4
  (int3) rows with an fp16 scale and zero point per token (absmax): a second, cheaper window tier;
  ``tier4k``: the same at int4 for their keys only (their values in the config's formats).

Writes one row per (segment, variant, decode step) with the step's KL and whether the top-1 token
agrees with the reference.

Usage (from the repository root): PYTHONPATH=. python experiments/where-does-the-held-out-kl-come-from/steps.py
    CONFIG OUT.csv [--segments 0 1] [--variants config keys values prompt]
"""
from __future__ import annotations

import pandas as pd
import torch

from bench.heldout import protocol_parser, protocol_runs
from kverr.config import CacheConfig, Override
from kverr.evaluation import next_token_kl, teacher_forced
from kverr.hf import KverrCache
from kverr.quant import float_format, quantize
from kverr.quant.formats import PerToken, int_format


def variant(cfg: CacheConfig, name: str) -> CacheConfig:
    if name not in ("keys", "values"):
        return cfg
    keep, drop = {"keys": ("k", "v"), "values": ("v", "k")}[name]
    heads = {h: Override(**{keep: getattr(o, keep)}) for h, o in cfg.heads.items() if getattr(o, keep)}
    return cfg.with_(**{drop: float_format("fp16")}, heads=heads, name=f"{cfg.name}-{name}")


def freeze_after_flush(cache) -> None:
    """Once the prompt is quantized whole, no pending token is quantized again: the decode tokens
    stay the int8 rows the window holds."""
    flush = cache.flush

    def flush_then_freeze():
        flush()
        for layer in cache.layers:
            layer._flushable = lambda g, respect_window, _f=layer._flushable: 0 if respect_window else _f(g, False)

    cache.flush = flush_then_freeze


def tiered(cache, prefill: int, bits: int, sides: str = "kv") -> None:
    """Decode tokens leaving the window go to ``bits``-bit per-token rows instead of the config's
    format (on ``sides``)."""
    fmt = int_format(bits, PerToken())
    for layer in cache.layers:
        def q(which, g, x, _q=layer._quantize):
            if which in sides and g.n_sinks + g.n_quantized >= prefill:
                return quantize(x, fmt)
            return _q(which, g, x)
        layer._quantize = q


def run(model, cfg, ids, prefill, variant_name):
    cache = KverrCache.for_model(model, cfg)
    if variant_name.startswith("tier"):
        tiered(cache, prefill, int(variant_name[4]), "k" if variant_name == "tier4k" else "kv")
    if variant_name == "fitall":
        for layer in cache.layers:
            layer._fit_tokens = lambda g, x: x
    if variant_name == "prompt":
        freeze_after_flush(cache)
    return teacher_forced(model, cache, ids, prefill, flush=True)


VARIANTS = ("config", "keys", "values", "prompt", "fitall", "tier4", "tier3", "tier4k")


@torch.no_grad()
def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--variants", nargs="+", default=["config", "keys", "values", "prompt"], choices=VARIANTS)
    a = ap.parse_args(argv)
    loaded, cfg, runs = protocol_runs(a)
    model = loaded.model
    rows = []
    for p, seg, off, ids, ref in runs:
        for v in a.variants:
            logp = run(model, variant(cfg, v), ids, p, v)
            kl = next_token_kl(ref, logp)
            top = logp.argmax(-1) == ref.argmax(-1)
            for d in range(kl.shape[0]):
                rows.append({"config": cfg.name, "segment": seg, "offset": off, "variant": v, "step": d,
                             "kl": float(kl[d]), "top1": bool(top[d])})
            print(f"{cfg.name} seg {seg} {v}: mean KL {float(kl.mean()):.4g}, top-1 {float(top.double().mean()):.3f}",
                  flush=True)
            pd.DataFrame(rows).to_csv(a.out, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
