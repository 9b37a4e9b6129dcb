"""How much of the held-out KL do the decode tokens owe to static scales fitted on the prompt alone?

Per segment (typing.py, P = 1024 quantized whole after the prefill, N = 256 teacher-forced steps,
as ``kverr evaluate``): the config as is (``prompt``: every static per-channel scale fitted on the
prompt's quantized tokens, which the decode tokens that leave the window then clamp against), and
with those scales fitted instead on the tokens of the prompt *and* of the decode steps (``all``:
an oracle no server has, since it sees the future; ``all-k``: for the keys only, the values'
scales fitted on the prompt). The oracle's scales come from a first pass that prefills all P + N
tokens through the same config and quantizes them whole; the second pass is the protocol's run
with those scales given. The salient tokens left out of the fit are the first pass's.

Usage (from the repository root): PYTHONPATH=. python experiments/do-decode-tokens-clamp-against-the-prompt-s-scales/oracle.py
    CONFIG OUT.csv [--segments 0] [--variants prompt all all-k] [--compensated-keys] [--refit]
"""
from __future__ import annotations

import torch

from bench.heldout import PREFILL, protocol_parser, protocol_runs, record
from kverr.hf.reference import KverrLayer
from kverr.quant import is_static

SCALES: dict = {}  # (layer, K|V, heads) -> (scale, zero) of the first pass
MODE = {"collect": False, "sides": ()}
_quantize = KverrLayer._quantize


def quantize(self, which, g, x):
    static = not g.fmt.is_float and is_static(g.fmt.granularity)
    key = (self.layer_idx, which, tuple(g.heads))
    if static and g.static_scale is None and which in MODE["sides"] and not MODE["collect"]:
        g.static_scale, g.static_zero = SCALES[key]
    out = _quantize(self, which, g, x)
    if static and MODE["collect"]:
        SCALES[key] = (g.static_scale, g.static_zero)
    return out


KverrLayer._quantize = quantize

SIDES = {"prompt": (), "all": ("k", "v"), "all-k": ("k",)}


@torch.no_grad()
def main(argv=None) -> int:
    from kverr.calibration.refit import refit_widths
    from kverr.capturing import capture
    from kverr.evaluation import compare, teacher_forced
    from kverr.hf import KverrCache, cache_kwarg

    ap = protocol_parser(__doc__)
    ap.add_argument("--variants", nargs="+", default=["prompt", "all"], choices=tuple(SIDES))
    ap.add_argument("--compensated-keys", action="store_true", help="keys rounded with compensation (+ck)")
    ap.add_argument("--refit", action="store_true", help="widths refit on each prompt (kverr evaluate --refit-widths)")
    a = ap.parse_args(argv)
    loaded, cfg, runs = protocol_runs(a)
    if a.compensated_keys:
        cfg = cfg.with_(key_rounding="compensated")
    name = cfg.name + ("+ck" if a.compensated_keys else "") + ("+refit" if a.refit else "")
    model = loaded.model
    rows = []
    for p, seg, off, ids, ref in runs:
        assert p == PREFILL
        run_cfg = refit_widths(cfg, capture(loaded, ids[:p])) if a.refit else cfg
        if any(SIDES[v] for v in a.variants):
            SCALES.clear()
            MODE.update(collect=True, sides=())
            first = KverrCache.for_model(model, run_cfg)  # the tokens the run feeds: prompt and N steps
            model(ids[None, :-1], use_cache=True, **{cache_kwarg(model): first})
            first.flush()
            MODE["collect"] = False
        for v in a.variants:
            MODE["sides"] = SIDES[v]
            logp = teacher_forced(model, KverrCache.for_model(model, run_cfg), ids, p, flush=True)
            row = {"config": name, "segment": seg, "offset": off, "scales": v, **compare(ref, logp, ids[p + 1:])}
            record(rows, row, a.out, f"{name} seg {seg} scales fitted on {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
