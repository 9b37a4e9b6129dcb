"""Which saliency chooses the salient tokens best? Measured KL of a salient config under three rules.

The library chooses, per (layer, kv head), the prompt tokens with the largest ``Σ a_qt²`` over the
prompt's last 256 queries (``"a2"``): the weight a *value* error takes. The keys carry the gain
(``sides-2026-12-03.txt``), and a key error at ``t`` moves the output of query ``q`` along
``v_t − o_q`` by ``a_qt · δs_qt``, so its expected cost is ``Σ_q a_qt² ‖v_t − o_q‖² E[δs_qt²]``:

* ``"key"``: ``Σ_q a_qt² ‖v_t − o_q‖² c²‖q‖²`` (an isotropic key error of the same size at every
  token);
* ``"exact"``: the tokens' own errors under the config's formats (the oracle's reconstruction of
  the prefill): ``Σ_q a_qt² (‖v_t − o_q‖² δs_qt² + ‖e_v,t‖²)``, ``δs = c q·e_k,t``, the first-order
  output error each token's rows would remove (cross terms between tokens left out).

Everything else is the library's (``KverrCache`` with the config's ``salient`` = N, candidates,
static scales); the rule replaces :func:`kverr.error.salient.positions` for the run.

Usage: python rules.py CONFIG [CONFIG ...] [--segments 0 1] [--rules a2 key exact]
"""
from __future__ import annotations

import argparse
import sys

import torch

import kverr.error.salient as salient_mod
import kverr.hf.salient as hf_salient
from kverr.capturing import load_model
from kverr.capturing.text import load_text
from kverr.config import CacheConfig
from kverr.evaluation import compare, segment_jobs, teacher_forced
from kverr.hf import KverrCache
from kverr.quant.store import reconstruct, salient_candidates

_library_positions = salient_mod.positions
_observe = hf_salient._observe
_VALUES: list[torch.Tensor] = []
RULE = {"name": "a2"}


def _observe_with_values(module, query, key, value, kwargs):
    _VALUES[:] = [value.detach()]
    return _observe(module, query, key, value, kwargs)


def rule_saliency(rule, config, layer, query, key, value, scaling):
    """``[kv head, n]`` float64 saliency of one sequence (``query [Hq, n, D]``, ``key``/``value``
    ``[Hkv, n, D]``) under ``rule``; causal attention of the last OBSERVED_QUERIES queries."""
    Hq, n, _ = query.shape
    Hkv = key.shape[0]
    G = Hq // Hkv
    Q = min(salient_mod.OBSERVED_QUERIES, n)
    rows = torch.arange(n - Q, n)
    allowed = torch.arange(n)[None, :] <= rows[:, None]
    if rule == "exact":
        ek = reconstruct(key[None], config, layer=layer, which="k")[0] - key.float()
        ev = reconstruct(value[None], config, layer=layer, which="v")[0] - value.float()
    out = torch.empty((Hkv, n), dtype=torch.float64)
    for h in range(Hkv):
        q = query[h * G:(h + 1) * G, n - Q:].double().reshape(G * Q, -1)
        k, v = key[h].double(), value[h].double()
        s = (q @ k.T * scaling).masked_fill(~allowed.repeat(G, 1), float("-inf"))
        a = torch.softmax(s, -1)
        a2 = a ** 2
        if rule == "a2":
            out[h] = a2.sum(0)
            continue
        o = a @ v  # [M, D]
        # ‖v_t − o_q‖² = ‖v_t‖² − 2 v_t·o_q + ‖o_q‖²
        dist = (v * v).sum(-1)[None, :] - 2 * o @ v.T + (o * o).sum(-1)[:, None]
        if rule == "key":
            w = a2 * dist * ((q * q).sum(-1) * scaling ** 2)[:, None]
        else:
            ds = q @ ek[h].double().T * scaling
            w = a2 * (dist * ds ** 2 + (ev[h].double() ** 2).sum(-1)[None, :])
        out[h] = w.sum(0)
    return out


def rule_positions(config, layer, query, key, scaling, *, sliding_window=0, sink=None):
    if sliding_window or sink is not None:
        raise NotImplementedError("rules.py covers full-attention models without learned sinks")
    value = _VALUES[0]
    H, n = key.shape[1], key.shape[2]
    sal = torch.stack([rule_saliency(RULE["name"], config, layer, query[b], key[b], value[b], scaling)
                       for b in range(query.shape[0])])
    spans = [salient_candidates(n, config, layer, h) for h in range(H)]
    m = min([config.salient] + [hi - lo for lo, hi in spans])
    return torch.stack([salient_mod.choose(sal[:, h], lo, hi, m) for h, (lo, hi) in enumerate(spans)], 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--text", default="/root/.pyenv/versions/3.11.7/lib/python3.11/typing.py")
    ap.add_argument("--segments", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--rules", nargs="+", default=["a2", "key", "exact"], choices=["a2", "key", "exact"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    hf_salient._observe = _observe_with_values
    salient_mod.positions = rule_positions
    loaded = load_model("default")
    model = loaded.model
    configs = [CacheConfig.load(c) for c in a.configs]
    jobs = segment_jobs(loaded, load_text(a.text), prefill=[a.prefill], decode=a.decode,
                        segments=max(a.segments) + 1, offset=a.offset)
    print("config segment rule mean_kl top1", flush=True)
    for p, i, off, ids in jobs:
        if i not in a.segments:
            continue
        from transformers import DynamicCache

        ref = teacher_forced(model, DynamicCache(), ids, p, flush=False)
        targets = ids[p + 1:]
        for cfg in configs:
            for rule in a.rules:
                RULE["name"] = rule
                cache = KverrCache.for_model(model, cfg)
                m = compare(ref, teacher_forced(model, cache, ids, p, flush=True), targets)
                print(f"{cfg.name} {i} {rule} {m['mean_kl']:.5f} {m['top1']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
