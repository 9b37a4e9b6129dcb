"""Held-out KL of a config whose decode tokens, when they leave the window, are stored in a
second window tier: the config's format one bit wider, or with scales that cover the prompt's
whole range, or both.

The tier's format for a (layer, kv head group, K|V) is the config's integer format with every
channel ``--widen`` bits wider, up to 4 bits (``channel_bits`` widths 2 -> 3 -> 4 with 1; width 0
stays 0, 4 and 8 stay), same granularity, rotation and rounding (compensated keys stay
compensated), clipped as the config's format (``--clip config``) or not at all (``--clip
absmax``); codebook, fp8 and plain-float formats keep their format. With ``--rows b`` the tier
holds every format's tokens as b-bit rows with an fp16 scale and zero point per token instead
(absmax, ``--rotate hadamard`` to rotate them first; keys rounded with compensation when the
config's are), which follow each token's own range. A static-scale tier format
gets its own static scales, fitted on the same prompt tokens as the config's, beside the
config's. Per
segment (typing.py, P = 1024 prompt tokens quantized whole after the prefill, N = 256
teacher-forced decode steps) the prompt is quantized in the config's formats and every decode
token that leaves the window (up to 192 of them: the tier is as long as the protocol's decode
past the window) in the tier's.

The tier's bytes (:func:`tier_bits`): per token and head, the tier format's codes less the
config's (scales per token block are the same count), over ``--tier`` tokens at ``--context``
tokens, plus its static scales once per ``--batch`` sequences; printed beside the config's own
effective bits.

Usage (from the repository root): PYTHONPATH=. python experiments/does-a-second-window-tier-pay/tier.py
    CONFIG OUT.csv [--segments 0 4] [--sides k|kv] [--widen 0|1] [--clip config|absmax]
    [--rows 0|3|4] [--rotate none|hadamard] [--compensated-keys] [--refit] [--skip-base]
"""
from __future__ import annotations

from dataclasses import replace

from bench.heldout import DECODE, PREFILL, protocol_parser, protocol_runs, protocol_switch, record
from kverr.config import WHICH, CacheConfig
from kverr.hf.reference import KverrLayer
from kverr.memory import account, group_bytes, model_shape
from kverr.quant.formats import AbsMax, PerToken, QuantFormat, int_format, is_static
from kverr.quant.store import fit_static_scales

ON = {"tier": False, "sides": "k", "scales": {}, "clip": "config", "widen": 1, "rows": 0, "rotate": "none"}


def widened(fmt: QuantFormat) -> QuantFormat | None:
    """The tier's format for ``fmt``: with ``ON["rows"]`` = b, b-bit rows with an fp16 scale and
    zero point per token (absmax); else ``ON["widen"]`` bits wider per channel, up to 4, clipped
    as ``ON["clip"]`` says (None: the tier would store ``fmt`` itself)."""
    if ON["rows"]:
        return int_format(ON["rows"], PerToken(), rotate=ON["rotate"])
    if fmt.dtype != "int":
        return None
    up = ON["widen"]
    if fmt.channel_bits is not None:
        tier = replace(fmt, channel_bits=tuple(min(b + up, 4) if b in (2, 3) else b for b in fmt.channel_bits))
    else:
        tier = fmt.with_bits(min(fmt.bits + up, 4)) if fmt.bits in (2, 3) else fmt
    if ON["clip"] == "absmax":
        tier = replace(tier, clip=AbsMax())
    return None if tier == fmt else tier


_quantize = KverrLayer._quantize


def quantize_tiered(self, which, g, x):
    wide = widened(g.fmt) if ON["tier"] and which in ON["sides"] else None
    if wide is None:
        return _quantize(self, which, g, x)
    if g.n_sinks + g.n_quantized < PREFILL:  # the prompt: the config's format
        key = (self.layer_idx, which, tuple(g.heads))
        if is_static(wide.granularity) and key not in ON["scales"]:  # the tier's scales, on the same tokens
            ON["scales"][key] = fit_static_scales([self._fit_tokens(g, x)], wide, self.config.page_size)
        return _quantize(self, which, g, x)
    scale, zero = ON["scales"].get((self.layer_idx, which, tuple(g.heads)), (None, None))
    return self._encode(replace(g, fmt=wide), x, scale, zero)


KverrLayer._quantize = quantize_tiered


def token_bytes(fmt: QuantFormat, D: int, page_size: int) -> float:
    """Bytes a token of one head stores in ``fmt`` beside its sequence's static bytes: its codes,
    and the scales and zero points of dynamic formats (:func:`kverr.memory.group_bytes` over
    three whole pages)."""
    T = 3 * page_size
    b = group_bytes(CacheConfig(k=fmt, v=fmt, sinks=0, window=0, page_size=page_size), fmt, 1, T, D, 1, which="k")[0]
    return (b.payload + b.scales + b.zeros) / T


def tier_bits(cfg: CacheConfig, sides: str, tier: int, context: int, batch: int) -> float:
    """Bits per cached element at ``context`` tokens that a ``tier``-token tier on ``sides`` adds."""
    shape = model_shape("default")
    D, P, extra = shape.head_dim, cfg.page_size, 0.0
    for layer in range(shape.n_layers):
        for w in WHICH:
            if w not in sides:
                continue
            for fmt, heads in cfg.head_groups(layer, shape.n_kv_heads, w):
                wide = widened(fmt)
                if wide is None:
                    continue
                extra += batch * len(heads) * tier * (token_bytes(wide, D, P) - token_bytes(fmt, D, P))
                extra += group_bytes(cfg, wide, len(heads), context, D, batch, which=w)[0].static
    return 8 * extra / (batch * shape.n_layers * shape.n_kv_heads * 2 * D * context)


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--sides", choices=("k", "kv"), default="k", help="which sides the tier holds")
    ap.add_argument("--compensated-keys", action="store_true", help="keys rounded with compensation (+ck)")
    ap.add_argument("--refit", action="store_true", help="widths refit on each prompt (kverr evaluate --refit-widths)")
    ap.add_argument("--skip-base", action="store_true", help="measure the tiered config only")
    ap.add_argument("--clip", choices=("config", "absmax"), default="config",
                    help="the tier's clipping: the config format's, or none (scales cover the prompt's range)")
    ap.add_argument("--widen", type=int, choices=(0, 1), default=1, help="bits the tier adds per channel")
    ap.add_argument("--rows", type=int, choices=(0, 3, 4), default=0,
                    help="the tier holds b-bit per-token rows (fp16 scale and zero, absmax) instead (0: widen)")
    ap.add_argument("--rotate", choices=("none", "hadamard"), default="none", help="the rows' rotation (with --rows)")
    ap.add_argument("--tier", type=int, default=DECODE - 64, help="tokens the tier holds (bytes only)")
    ap.add_argument("--context", type=int, default=PREFILL + DECODE, help="context the bits count at")
    ap.add_argument("--batch", type=int, default=8, help="sequences the static bytes are shared by")
    a = ap.parse_args(argv)
    loaded, cfg, runs = protocol_runs(a)
    if a.compensated_keys:
        cfg = cfg.with_(key_rounding="compensated")
    ON.update(sides=a.sides, clip=a.clip, widen=a.widen, rows=a.rows, rotate=a.rotate)  # the tier's formats, which its bytes count
    shape = model_shape("default")
    base = account(cfg, shape, a.context, batch=a.batch, prefill_quantized=PREFILL).effective_bits
    extra = tier_bits(cfg, a.sides, a.tier, a.context, a.batch)
    print(f"{cfg.name}: {base:.4f} bits, tier on {a.sides} +{extra:.4f} = {base + extra:.4f} bits "
          f"({a.tier} tokens at {a.context}, static bytes over {a.batch} sequences)", flush=True)
    name = cfg.name + ("+ck" if a.compensated_keys else "") + ("+refit" if a.refit else "")
    rows = []

    def switch(on):
        ON.update(tier=on, scales={})

    for seg, off, on, measured in protocol_switch(loaded, cfg, runs, switch, refit=a.refit, skip_base=a.skip_base):
        row = {"config": name, "tier": a.sides if on else None, "clip": a.clip if on else None,
               "widen": a.widen if on else None, "rows": a.rows if on else None, "rotate": a.rotate if on and a.rows else None, "bits": base + (extra if on else 0.0),
               "segment": seg, "offset": off, **measured}
        record(rows, row, a.out, f"{name} seg {seg} tier {row['tier']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
