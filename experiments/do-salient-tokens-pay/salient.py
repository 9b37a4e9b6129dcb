"""Measured KL of a config when each (layer, kv head)'s most-attended prompt tokens are kept as
int8 rows (as the sinks are) instead of quantized.

Per segment (the README's protocol: typing.py, P prompt tokens, N teacher-forced decode steps):
the reference run; the config as is; then, per fraction f, the config with the f·P prompt tokens
of highest saliency per (layer, kv head) read back as their int8 round trip. Saliency of token t
for kv head g: sum over the last Q prompt queries and the query heads of g of a_qt^2 (the weight
a value error at t takes in the value term), from the full-precision prefill's attention; with
``--oracle`` from the decode queries' attention instead (a bound no server can reach).

With ``--sides k v`` the rows replace the keys only, then the values only (default ``kv``: both).

Usage: python salient.py CONFIG [--segments 0 1] [--fractions 0.01 0.02 0.05] [--queries 256] [--sides kv k v]
"""
from __future__ import annotations

import argparse
import sys

import torch

from kverr.capturing import load_model
from kverr.capturing.text import load_text
from kverr.config import CacheConfig
from kverr.evaluation import compare, segment_jobs, teacher_forced
from kverr.hf import KverrCache


@torch.no_grad()
def saliency(model, ids, prefill, queries, oracle):
    """[layer, kv head, prefill] saliency from the full-precision attention."""
    model.set_attn_implementation("eager")
    try:
        hi = ids.shape[0] - 1 if oracle else prefill
        out = model(ids[None, :hi], output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    lo = prefill if oracle else prefill - queries
    sal = []
    for a in out.attentions:  # [1, H, T, T]
        a = a[0, :, lo:hi, :prefill].double() ** 2
        H = a.shape[0]
        kv = model.config.num_key_value_heads
        sal.append(a.sum(1).reshape(kv, H // kv, prefill).sum(1))
    return torch.stack(sal)


def patch(cache, keep, originals, sides="kv"):
    """Make every layer read the ``keep`` rows of the prompt as their int8 round trip (keys,
    values or both: ``sides``)."""
    for li, layer in enumerate(cache.layers):
        read = layer._read

        def patched(which, read=read, li=li):
            x = read(which)
            orig = originals.get((li, which))
            if x is None or orig is None or which not in sides:
                return x
            for h in range(x.shape[1]):
                idx = keep[li, h]
                x[:, h, idx] = orig[:, h, idx]
            return x

        layer._read = patched


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--text", default="/root/.pyenv/versions/3.11.7/lib/python3.11/typing.py")
    ap.add_argument("--segments", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.02, 0.05])
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--oracle", action="store_true")
    ap.add_argument("--sides", nargs="+", default=["kv"], choices=["kv", "k", "v"])
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    loaded = load_model("default")
    model = loaded.model
    cfg = CacheConfig.load(a.config)
    jobs = segment_jobs(loaded, load_text(a.text), prefill=[a.prefill], decode=a.decode,
                        segments=max(a.segments) + 1, offset=0)
    print("segment fraction sides mean_kl top1", flush=True)
    for p, i, off, ids in jobs:
        if i not in a.segments:
            continue
        from transformers import DynamicCache

        ref = teacher_forced(model, DynamicCache(), ids, p, flush=False)
        targets = ids[p + 1:]
        sal = saliency(model, ids, p, a.queries, a.oracle)
        sal[:, :, :cfg.sinks] = -1  # the sinks are kept already
        # the prompt's own keys and values, as the int8 window holds them
        originals = {}
        grab = KverrCache.for_model(model, cfg.with_(window=p, sinks=0, provenance={}))
        model(ids[None, :p], use_cache=True, past_key_values=grab)
        for li, layer in enumerate(grab.layers):
            for w in ("k", "v"):
                originals[(li, w)] = layer._read(w)  # window rows: as the sinks hold them
        for f, sides in [(0.0, "kv")] + [(f, s) for f in a.fractions for s in a.sides]:
            k = int(round(f * p))
            keep = sal.topk(k, dim=-1).indices if k else sal[..., :0].long()
            cache = KverrCache.for_model(model, cfg)
            if k:
                patch(cache, keep, originals, sides)
            m = compare(ref, teacher_forced(model, cache, ids, p, flush=True), targets)
            print(f"{i} {f:.3f} {sides} {m['mean_kl']:.5f} {m['top1']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
