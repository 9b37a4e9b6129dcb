"""Would keeping a few decode tokens per head as int8 rows -- salient tokens chosen as the prompt's
are, but among the tokens that leave the window during decode -- take the decode tokens' share of
the held-out KL?

Per segment (typing.py, P = 1024 quantized whole after the prefill, N = 256 teacher-forced steps):
the config as is, then with ``k`` decode tokens per (layer, kv head) and per 64 decode tokens kept
as the int8 rows the window held (both K and V, the same positions), chosen by ``sum a^2`` over the
queries that read them while they were in the window (positions ``t .. t + R - 1``) and the kv head's
query heads, from the full-precision run's attention (what a server would take from its own run).

Usage (from the repository root): PYTHONPATH=. python experiments/where-does-the-held-out-kl-come-from/decode_salient.py
    CONFIG OUT.csv [--segments 0] [--keep 1 2 4]
"""
from __future__ import annotations

import pandas as pd
import torch

from bench.heldout import protocol_parser, protocol_runs
from kverr.evaluation import compare, teacher_forced
from kverr.hf import KverrCache
from kverr.hf.reference import KverrLayer
from kverr.rope import rotate

KEEP: dict = {}  # layer -> [kv head, k] absolute positions kept, or empty
SAVED: dict = {}  # (layer, K|V) -> {(kv head, position): the int8 row as the cache reads it}
_quantize, _read = KverrLayer._quantize, KverrLayer._read


def quantize(self, which, g, x):
    """Remember the int8 rows (``x``: the block as the window held it) of the kept tokens."""
    keep = KEEP.get(self.layer_idx)
    lo = g.n_sinks + g.n_quantized
    if keep is not None:
        for i, h in enumerate(g.heads):
            for t in (int(t) for t in keep[h] if lo <= t < lo + x.shape[2]):
                row = x[:, i, t - lo].float()
                if which == "k" and self.config.key_pre_rope:
                    cos, sin = self._cos_sin(t, t + 1)
                    row = rotate(row[:, None], cos, sin)[:, 0]
                SAVED.setdefault((self.layer_idx, which), {})[(h, t)] = row
    return _quantize(self, which, g, x)


def read(self, which):
    out = _read(self, which)
    for (h, t), row in SAVED.get((self.layer_idx, which), {}).items():
        out[:, h, t] = row
    return out


KverrLayer._read = read
KverrLayer._quantize = quantize


@torch.no_grad()
def decode_saliency(model, ids, prefill, window):
    """[layer, kv head, N] sum of a^2 over the queries that read each decode token in the window."""
    model.set_attn_implementation("eager")
    try:
        out = model(ids[None, :-1], output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    kv = model.config.num_key_value_heads
    T = ids.shape[0] - 1
    sal = []
    for a in out.attentions:  # [1, H, T, T]
        a2 = a[0].double() ** 2
        H = a2.shape[0]
        s = torch.zeros(H, T - prefill, dtype=torch.float64)
        for t in range(prefill, T):
            s[:, t - prefill] = a2[:, t:min(T, t + window), t].sum(-1)
        sal.append(s.reshape(kv, H // kv, -1).sum(1))
    return torch.stack(sal)


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--keep", type=int, nargs="+", default=[1, 2, 4], help="decode tokens kept per block")
    ap.add_argument("--block", type=int, default=64, help="decode tokens per block")
    a = ap.parse_args(argv)
    loaded, cfg, runs = protocol_runs(a)
    model = loaded.model
    rows = []
    for p, seg, off, ids, ref in runs:
        sal = decode_saliency(model, ids, p, cfg.window)
        n_q = ids.shape[0] - 1 - p - cfg.window  # decode tokens that leave the window
        for k in a.keep:
            KEEP.clear()
            SAVED.clear()
            for li in range(sal.shape[0]):
                picks = []
                for b0 in range(0, n_q, a.block):
                    s = sal[li, :, b0:min(n_q, b0 + a.block)]
                    picks.append(s.topk(min(k, s.shape[-1]), dim=-1).indices + b0 + p)
                KEEP[li] = torch.cat(picks, dim=-1) if k else torch.zeros(sal.shape[1], 0, dtype=torch.long)
            logp = teacher_forced(model, KverrCache.for_model(model, cfg), ids, p, flush=True)
            row = {"config": cfg.name, "segment": seg, "offset": off, "keep_per_block": k, "block": a.block,
                   **compare(ref, logp, ids[p + 1:])}
            rows.append(row)
            print(f"{cfg.name} seg {seg} keep {k}/{a.block}: mean KL {row['mean_kl']:.4g} top-1 {row['top1']:.3f}",
                  flush=True)
            pd.DataFrame(rows).to_csv(a.out, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
