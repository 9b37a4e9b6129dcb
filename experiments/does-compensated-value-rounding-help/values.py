"""Held-out KL of a config when its values, too, are rounded with error compensation, weighed by
what the output projection makes of a value error.

A value error ``e`` at token ``t`` reaches query head ``i`` as ``a_it e`` and the layer's output
as ``W_i a_it e`` (``W_i`` the columns of ``o_proj`` that read head ``i``), so its cost over the
query heads that read kv head ``h`` is ``eᵀ (Σ_i a_it² W_iᵀ W_i) e``. With the attention left out
(``--weight gram``) that is the Gram matrix ``G_h = Σ_i W_iᵀ W_i``, one per (layer, kv head),
fixed by the model's weights; ``--weight attention`` weighs each query head by the mean squared
attention its last ``--queries`` prefill queries give the token (prompt tokens; decode tokens the
mean over the prompt's tokens). Values in integer formats that encode with the stored scale are
rounded by :func:`kverr.quant.compensated.compensated_quantize` under that cost (same grid, same
bytes, only the codes change); other formats as the config stores them. Keys as the config says
(``--keys compensated`` rounds them with compensation too, as ``kverr evaluate --compensated-keys``).

Per segment (typing.py, P = 1024 quantized whole after the prefill, N = 256 teacher-forced
decode steps): the config with values rounded to nearest and with compensated values.

Usage (from the repository root): PYTHONPATH=. python experiments/does-compensated-value-rounding-help/values.py
    CONFIG OUT.csv [--segments 0 4] [--keys nearest|compensated] [--refit] [--skip-base]
"""
from __future__ import annotations

import torch

from bench.heldout import protocol_parser, protocol_runs, protocol_switch, record
from kverr.hf.reference import KverrLayer
from kverr.quant.compensated import compensable, compensated_quantize

ON = {"values": False, "weight": "gram", "queries": 256, "gram": {}}


def grams(model) -> dict[int, torch.Tensor]:
    """Per layer ``[kv_head, D, D]`` float64: ``Σ_i W_iᵀ W_i`` over the query heads ``i`` of each kv head."""
    cfg = model.config
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    out = {}
    for li, layer in enumerate(model.model.layers):
        W = layer.self_attn.o_proj.weight.detach().double().reshape(-1, Hq, D)  # [hidden, q_head, D]
        g = torch.einsum("ohd,ohe->hde", W, W)  # [q_head, D, D]
        out[li] = g.reshape(Hkv, Hq // Hkv, D, D)  # per kv head, per query head in it
    return out


_observe, _encode = KverrLayer.observe, KverrLayer._encode


def observe(self, query, key, scaling, **kw):
    if ON["values"]:
        per_head = ON["gram"][self.layer_idx]  # [kv, G, D, D]
        if ON["weight"] == "gram":
            cost = per_head.sum(1)[None, :, None]  # [1, kv, 1, D, D]
        else:  # each query head weighed by the mean squared attention its last queries give each prompt token
            B, Hq, n, D = query.shape
            kv, G = per_head.shape[:2]
            rows = torch.arange(max(n - ON["queries"], 0), n)
            s = torch.einsum("bhqd,bhtd->bhqt", query[:, :, rows].float(),
                             key.float().repeat_interleave(G, dim=1)) * scaling
            s = s.masked_fill(torch.arange(n)[None, :] > rows[:, None], float("-inf"))
            w = (torch.softmax(s, -1) ** 2).mean(2).double().reshape(B, kv, G, n)  # [B, kv, G, n]
            w = w / w.mean(-1, keepdim=True).clamp_min(1e-30)  # relative to the mean token's
            cost = torch.einsum("bkgt,kgde->bktde", w, per_head)  # [B, kv, n, D, D]
            self._value_mean = per_head.sum(1)[None, :, None]
        self._value_cost = cost
    return _observe(self, query, key, scaling, **kw)


def encode(self, g, x, scale=None, zero=None):
    if not ON["values"] or g.key_cost is not None or g not in self.groups["v"] or not compensable(g.fmt):
        return _encode(self, g, x, scale, zero)
    cost = self._value_cost[:, g.heads]
    if cost.shape[2] > 1:  # per prompt token; later tokens (decode) the unweighted Gram
        lo = g.n_sinks + g.n_quantized
        n = x.shape[2]
        if lo + n <= cost.shape[2]:
            cost = cost[:, :, lo:lo + n]
        else:
            cost = self._value_mean[:, g.heads]
    return compensated_quantize(x, g.fmt, cost, page_size=self.config.page_size, scale=scale, zero=zero)


KverrLayer.observe, KverrLayer._encode = observe, encode


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--keys", choices=("nearest", "compensated"), default="nearest", help="how keys are rounded")
    ap.add_argument("--weight", choices=("gram", "attention"), default="gram")
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--refit", action="store_true", help="refit the widths on each prompt (kverr evaluate --refit-widths)")
    ap.add_argument("--skip-base", action="store_true", help="measure the compensated values only")
    a = ap.parse_args(argv)
    loaded, cfg, runs = protocol_runs(a)
    if not cfg.salient and not cfg.compensates_keys and a.keys == "nearest":
        raise SystemExit("the cache must see the prefill's queries (salient tokens or compensated keys)")
    cfg = cfg.with_(key_rounding=a.keys)
    ON.update(weight=a.weight, queries=a.queries, gram=grams(loaded.model))
    rows = []
    for seg, off, on, measured in protocol_switch(loaded, cfg, runs, lambda on: ON.update(values=on),
                                                  refit=a.refit, skip_base=a.skip_base):
        name = "compensated" if on else "nearest"
        row = {"config": cfg.name + ("+ck" if a.keys == "compensated" else "") + ("+refit" if a.refit else ""),
               "values": name, "weight": a.weight if on else None, "segment": seg, "offset": off, **measured}
        record(rows, row, a.out, f"{row['config']} seg {seg} values {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
