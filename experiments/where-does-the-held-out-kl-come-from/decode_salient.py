"""Would keeping a few decode tokens per head as int8 rows -- salient tokens chosen as the prompt's
are, but among the tokens that leave the window during decode -- take the decode tokens' share of
the held-out KL?

Per segment (typing.py, P = 1024 quantized whole after the prefill, N = 256 teacher-forced steps):
the config as is, then with ``k`` decode tokens per (layer, kv head) and per 64 decode tokens kept
as the int8 rows the window held (both K and V, the same positions), chosen by ``sum a^2`` over the
queries that read them while they were in the window (positions ``t .. t + R - 1``) and the kv head's
query heads, from the full-precision run's attention (what a server would take from its own run).
With a window per head, the candidates are the tokens that leave the shortest window and ``R`` is
the config's ``window``; ``--keep`` equal to ``--block`` keeps every decode token, leaving the
prompt's quantization alone.

Each row's ``bits``: the config's effective bits at ``--context`` tokens (static bytes shared by
``--batch`` sequences, the prompt quantized whole) plus the kept rows (:func:`row_bits`).

Usage (from the repository root): PYTHONPATH=. python experiments/where-does-the-held-out-kl-come-from/decode_salient.py
    CONFIG OUT.csv [--segments 0] [--keep 0 2 8] [--compensated-keys] [--refit]
"""
from __future__ import annotations

import torch

from bench.heldout import DECODE, PREFILL, protocol_parser, protocol_runs, protocol_switch, record
from kverr.hf.reference import KverrLayer
from kverr.memory import account, model_shape, window_row_sections
from kverr.quant.store import SALIENT_INDEX_BYTES
from kverr.rope import rotate

KEEP: dict = {}  # layer -> [kv head, k] absolute positions kept, or empty
SAVED: dict = {}  # (layer, K|V) -> {(kv head, position): the int8 row as the cache reads it}
ROW = None  # or a function (K|V, row [B, D]) -> the row as kept (before RoPE), or None: not kept on that side
_quantize, _read = KverrLayer._quantize, KverrLayer._read


def quantize(self, which, g, x):
    """Remember the int8 rows (``x``: the block as the window held it) of the kept tokens."""
    keep = KEEP.get(self.layer_idx)
    lo = g.n_sinks + g.n_quantized
    if keep is not None:
        for i, h in enumerate(g.heads):
            for t in (int(t) for t in keep[h] if lo <= t < lo + x.shape[2]):
                row = x[:, i, t - lo].float()
                if ROW is not None and (row := ROW(which, row)) is None:
                    continue
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


def row_bits(kept: int, context: int, row_bytes: int | None = None, sides: int = 2) -> float:
    """Bits per cached element (K and V together) at ``context`` tokens that ``kept`` rows per
    (layer, kv head) add on ``sides`` of the two sides, beside the tokens' codes: each row
    ``row_bytes`` and a position, as :mod:`kverr.memory` counts a salient prompt token's (default:
    a window-dtype row, int8: ``D`` codes and an fp16 scale; row alignment left out)."""
    D = model_shape("default").head_dim
    per_row = (sum(window_row_sections("int8", D)) if row_bytes is None else row_bytes) + SALIENT_INDEX_BYTES
    return 8 * kept * per_row * sides / (2 * D * context)


def kept_rows_protocol(ap, argv):
    """What an experiment keeping int8 rows starts from: ``ap`` (a :func:`protocol_parser` with the
    experiment's own options) given the common ones and parsed; the model, the config (int8 window
    required; keys compensated with ``--compensated-keys``) and the segments' runs
    (:func:`protocol_runs`); the config's effective bits at ``--context`` tokens, static bytes shared
    by ``--batch`` sequences, the prompt quantized whole; and the name its rows carry.

    Returns ``(args, loaded, cfg, runs, base_bits, name)``."""
    ap.add_argument("--compensated-keys", action="store_true", help="keys rounded with compensation (+ck)")
    ap.add_argument("--refit", action="store_true", help="widths refit on each prompt (kverr evaluate --refit-widths)")
    ap.add_argument("--context", type=int, default=PREFILL + DECODE, help="context the bits count at")
    ap.add_argument("--batch", type=int, default=8, help="sequences the static bytes are shared by")
    a = ap.parse_args(argv)
    loaded, cfg, runs = protocol_runs(a)
    if cfg.window_dtype != "int8":
        raise SystemExit(f"{a.config}: the kept rows are the int8 window's; this config's window is {cfg.window_dtype}")
    if a.compensated_keys:
        cfg = cfg.with_(key_rounding="compensated")
    base = account(cfg, model_shape("default"), a.context, batch=a.batch, prefill_quantized=PREFILL).effective_bits
    name = cfg.name + ("+ck" if a.compensated_keys else "") + ("+refit" if a.refit else "")
    return a, loaded, cfg, runs, base, name


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--keep", type=int, nargs="+", default=[1, 2, 4],
                    help="decode tokens kept per block, a run each (0: the config as is)")
    ap.add_argument("--block", type=int, default=64, help="decode tokens per block")
    a, loaded, cfg, runs, base, name = kept_rows_protocol(ap, argv)
    model = loaded.model
    now: dict = {}  # the segment being run: its prompt length and decode saliency
    n_layers, n_kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    shortest = min(cfg.window_for(li, h, w) for li in range(n_layers) for h in range(n_kv) for w in "kv")

    def with_saliency(runs):
        for p, seg, off, ids, ref in runs:  # the eager forward for the attention only where rows are kept
            sal = decode_saliency(model, ids, p, cfg.window) if any(a.keep) else None
            # the decode tokens that leave a window: the shortest window's (a config may keep a
            # window per head; the saliency sums over the config's `window`)
            now.update(p=p, sal=sal, n_q=ids.shape[0] - 1 - p - shortest)
            yield p, seg, off, ids, ref

    def switch(k):
        KEEP.clear()
        SAVED.clear()
        now["kept"] = 0
        if not k:
            return
        sal, p, n_q = now["sal"], now["p"], now["n_q"]
        for li in range(sal.shape[0]):
            picks = []
            for b0 in range(0, n_q, a.block):
                s = sal[li, :, b0:min(n_q, b0 + a.block)]
                picks.append(s.topk(min(k, s.shape[-1]), dim=-1).indices + b0 + p)
            KEEP[li] = torch.cat(picks, dim=-1)
        now["kept"] = KEEP[0].shape[-1]

    rows = []
    for seg, off, k, measured in protocol_switch(loaded, cfg, with_saliency(runs), switch, refit=a.refit,
                                                 settings=a.keep):
        row = {"config": name, "segment": seg, "offset": off, "keep_per_block": k, "block": a.block,
               "bits": base + row_bits(now["kept"], a.context), **measured}
        record(rows, row, a.out, f"{name} seg {seg} keep {k}/{a.block} ({row['bits']:.4f} bits)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
