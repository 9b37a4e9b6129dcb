"""Must a cache that rounds keys with compensation keep each sequence's query moment?

A cache with ``key_rounding`` ``"compensated"`` rounds every integer key format's codes under the
second moment of the prefill's last queries -- prompt and decode tokens alike -- so it keeps that
moment (``[D, D]`` per layer and kv head) for each sequence as long as the sequence decodes: bytes
per sequence that ``kverr.memory`` does not count. This runs the held-out protocol of
``decode_salient.py`` (``--keep 0 --compensated-keys``) with the prompt's keys compensated and the
decode tokens' keys (those that leave the window) rounded to nearest on the same grid: the moment
is needed until the prompt is quantized -- the flush right after the prefill, but for the prompt's
last tokens in a block of several tokens (channel groups of 64) that fills during decode. The
library's rule (the moment dropped at the first decode step) rounds those to nearest too.

Usage (from the repository root): PYTHONPATH=. python experiments/does-compensation-need-per-sequence-state/prompt_tokens.py
    CONFIG OUT.csv --segments 0 1 2 3 --keep 0 --compensated-keys --refit
"""
from __future__ import annotations

import torch

from bench.heldout import experiment_script
from kverr.hf.reference import KverrLayer

# patches KverrLayer._quantize/_read (unused with --keep 0)
decode_salient = experiment_script("where-does-the-held-out-kl-come-from", "decode_salient.py")

_observe, _encode = KverrLayer.observe, KverrLayer._encode


def observe(self, query, key, scaling, **kw):
    self._prompt_tokens = self.cumulative_length  # the prompt: quantized under its own queries' moment
    return _observe(self, query, key, scaling, **kw)


def encode(self, g, x, scale=None, zero=None):
    """Compensated codes for the prompt's tokens, nearest ones (same scales) for later tokens."""
    n_prompt = getattr(self, "_prompt_tokens", None)
    lo = g.n_sinks + g.n_quantized
    if g.key_cost is None or n_prompt is None or lo + x.shape[2] <= n_prompt:
        return _encode(self, g, x, scale, zero)
    comp = _encode(self, g, x, scale, zero)
    cost, g.key_cost = g.key_cost, None
    try:
        near = _encode(self, g, x, scale, zero)
    finally:
        g.key_cost = cost
    assert torch.equal(near.scale, comp.scale) if near.scale is not None else comp.scale is None
    later = (torch.arange(x.shape[2]) + lo >= n_prompt).to(near.codes.device)  # packed per token row
    codes = torch.where(later[:, None], near.codes, comp.codes)
    return type(comp)(codes, comp.scale, comp.zero, comp.fmt, comp.shape, comp.page_size)


KverrLayer.observe = observe
KverrLayer._encode = encode

if __name__ == "__main__":
    raise SystemExit(decode_salient.main())
