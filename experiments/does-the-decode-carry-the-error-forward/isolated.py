"""How much of a config's held-out KL reaches a decode step through the earlier decode tokens'
keys and values, computed by a model whose hidden states the quantized cache already perturbed?

Per segment (typing.py, P = 1024 quantized whole after the prefill, N = 256 teacher-forced steps,
as ``kverr evaluate``), a run per ``--modes``: the config as is (``as-computed``); with every
decode token's incoming key and value replaced by the full-precision run's, then stored as the
config stores them (the int8 window, its codes once it leaves the window; ``exact``); and stored
so, but read by the token's own query, in the step that computes them, as computed
(``exact-before``: its key and value moved by the quantized run's perturbation, with the storage's
rounding error). ``exact`` keeps each step's own error from the quantized prompt and the decode
tokens' storage and removes every error the upstream layers put into a decode token's key and
value; ``exact-before`` removes only what the earlier steps hand on through the cache. With
``--sides k`` (or ``v``) the exact modes replace only the keys (values). Each row also has the
mean KL of each block of 64 decode steps.

Usage (from the repository root): PYTHONPATH=. python experiments/does-the-decode-carry-the-error-forward/isolated.py
    CONFIG OUT.csv [--segments 0] [--modes as-computed exact exact-before] [--sides kv] [--compensated-keys]
    [--refit] [--families k:widths+k:other]
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from bench.heldout import experiment_script, protocol_parser, protocol_segments, protocol_switch, record
from kverr import evaluation
from kverr.capturing import load_model
from kverr.config import CacheConfig
from kverr.hf.reference import KverrLayer

EXACT: dict = {}  # layer -> (keys, values) [1, kv head, T, D] of the full-precision run
#: What a decode token's incoming key and value are: as the quantized run computes them; as the
#: full-precision run did; or stored as the full-precision run's, but read by the token's own query
#: (in the step that computes them) as computed.
MODES = {"as-computed": "as computed", "exact": "exact", "exact-before": "exact for later steps"}
NOW: dict = {"prefill": None, "mode": "as-computed", "sides": "kv"}
_update = KverrLayer.update


def update(self, key_states, value_states, *args, **kwargs):
    """A decode step's keys and values as :data:`MODES` says."""
    start = self.cumulative_length
    mode = NOW["mode"]
    if mode == "as-computed" or start < NOW["prefill"]:
        return _update(self, key_states, value_states, *args, **kwargs)
    n = key_states.shape[-2]
    exact = [x[:, :, start:start + n].to(y.dtype) if w in NOW["sides"] else y
             for w, x, y in zip("kv", EXACT[self.layer_idx], (key_states, value_states))]
    k, v = _update(self, *exact, *args, **kwargs)
    if mode == "exact-before":
        # the stored rows as read back, moved by what the quantized run computed beyond the exact
        # run: the token's own query sees its perturbation with the storage's rounding error
        k, v = k.clone(), v.clone()
        k[:, :, -n:] += key_states - exact[0]
        v[:, :, -n:] += value_states - exact[1]
    return k, v


KverrLayer.update = update
BLOCK = 64  # decode steps per block of the per-block mean KL
_compare = evaluation.compare


def compare(ref_logp, logp, targets):
    """:func:`kverr.evaluation.compare`'s metrics, and the mean KL of each block of decode steps."""
    out = _compare(ref_logp, logp, targets)
    kl = evaluation.next_token_kl(ref_logp, logp)
    for b0 in range(0, kl.shape[0], BLOCK):
        out[f"kl_{b0}_{min(kl.shape[0], b0 + BLOCK)}"] = float(kl[b0:b0 + BLOCK].mean())
    return out


evaluation.compare = compare  # protocol_switch looks it up when it runs


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--compensated-keys", action="store_true", help="keys rounded with compensation (+ck)")
    ap.add_argument("--refit", action="store_true", help="widths refit on each prompt (kverr evaluate --refit-widths)")
    ap.add_argument("--families", help="only these format families quantized, as the families experiment "
                                       "writes them (k:widths+k:other: every key); the other groups fp32")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=["as-computed", "exact"],
                    help="what the decode tokens' keys and values are, a run each")
    ap.add_argument("--sides", choices=["kv", "k", "v"], default="kv",
                    help="the sides whose decode rows the exact modes replace (default both)")
    a = ap.parse_args(argv)
    NOW["sides"] = a.sides
    torch.set_num_threads(a.threads)
    loaded = load_model("default")
    cfg = CacheConfig.load(a.config)
    if a.compensated_keys:
        cfg = cfg.with_(key_rounding="compensated")
    if a.families:
        families = experiment_script("do-format-families-cost-what-the-objective-says", "families.py")
        n_layers, n_kv = loaded.model.config.num_hidden_layers, loaded.model.config.num_key_value_heads
        cfg = families.only(cfg, n_layers, n_kv, set(a.families.split("+")))
    name = (cfg.name + ("+ck" if a.compensated_keys else "") + ("+refit" if a.refit else "")
            + ("" if a.sides == "kv" else f"[exact {a.sides}]"))

    def runs():
        for p, seg, off, ids in protocol_segments(loaded, a.segments, a.text, a.offset):
            cache = DynamicCache()
            ref = evaluation.teacher_forced(loaded.model, cache, ids, p, flush=False)
            EXACT.clear()
            for li, layer in enumerate(cache.layers):
                EXACT[li] = (layer.keys.clone(), layer.values.clone())
            NOW["prefill"] = p
            yield p, seg, off, ids, ref

    def switch(mode):
        NOW["mode"] = mode

    rows = []
    for seg, off, mode, measured in protocol_switch(loaded, cfg, runs(), switch, refit=a.refit, settings=a.modes):
        row = {"config": name, "segment": seg, "offset": off, "decode_kv": MODES[mode], **measured}
        record(rows, row, a.out, f"{name} seg {seg} decode K/V {row['decode_kv']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
