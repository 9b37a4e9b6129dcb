"""Held-out KL of a config when its keys are rounded with error compensation (GPTQ's rule, one
token's key vector at a time) instead of to nearest, on the same grid.

A key error ``e`` at token ``t`` costs query ``q`` the score error ``c q'·R_t e`` (``R_t`` the
RoPE rotation of ``t`` when keys are stored before RoPE, the identity after), so its expected
cost over the queries is ``e^T H_t e`` with ``H_t = R_t^T H' R_t`` and ``H'`` the second moment
of the (post-RoPE) queries. Nearest rounding minimises ``|e|^2`` channel by channel; GPTQ's
sequential rule rounds channel ``j``, then moves the channels not yet rounded to cancel its error
as ``H_t`` weighs it (Cholesky factor of ``H_t^-1``), so that correlated channels -- and channels
the config gives no bits, which read back their mean -- are compensated. The grid (static
per-channel scales, zero points and widths) and the bytes stay the config's: only the codes change.

``H'`` per (layer, kv head) is the mean of ``q q^T`` over the prompt's last ``--queries`` queries
and the kv head's query heads, taken from the prefill (the cache sees them: the config keeps
salient tokens). Only asymmetric integer key formats with static per-channel scales are rounded
this way; every other format as the config stores it.

Per segment (typing.py, P = 1024 quantized whole after the prefill, N = 256 teacher-forced decode
steps): the reference, the config as is, the config with compensated keys. Also prints the
predicted key cost ``sum_t e^T H_t e`` of both roundings over the prompt, per layer total.

Usage (from the repository root): PYTHONPATH=. python experiments/does-error-compensated-rounding-help/gptq.py
    CONFIG OUT.csv [--segments 0 1] [--queries 256] [--skip-base] [--refit]
"""
from __future__ import annotations

from collections import defaultdict

import torch

from bench.heldout import protocol_parser, protocol_runs, protocol_switch, record
from kverr.config import CacheConfig
from kverr.hf.reference import KverrLayer
from kverr.quant.formats import is_static
from kverr.quant.reference import QTensor, hadamard_rotate, pack_codes
from kverr.rope import rotate

COST = defaultdict(lambda: [0.0, 0.0])  # layer -> [nearest, compensated] predicted key cost
ON = {"gptq": False, "queries": 256, "damp": 0.01, "weight": "moment", "mix": 1.0}


def second_moment(query: torch.Tensor, n_kv: int, last: int) -> torch.Tensor:
    """``[kv_head, D, D]`` mean ``q q^T`` over the last ``last`` positions and each kv head's query heads."""
    B, Hq, n, D = query.shape
    q = query[0, :, -last:].double().reshape(n_kv, Hq // n_kv * min(last, n), D)
    return torch.einsum("gnd,gne->gde", q, q) / q.shape[1]


def attention_moments(query: torch.Tensor, key: torch.Tensor, scaling: float, last: int) -> torch.Tensor:
    """``[kv_head, n, D, D]``: per prompt token ``t``, ``sum_q a_qt^2 q q^T`` over the last ``last``
    queries and the kv head's query heads (``a`` the prefill's causal attention), each divided by its
    trace -- the first-order cost of a key error at ``t`` (``|delta o_q|^2 ~ sum_t a_qt^2 (q.e_t)^2
    |v_t - o_q|^2``, the value spread left out)."""
    B, Hq, n, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    rows = torch.arange(max(n - last, 0), n)
    allowed = torch.arange(n)[None, :] <= rows[:, None]
    out = torch.empty((Hkv, n, D, D), dtype=torch.float32)
    for h in range(Hkv):
        q = query[0, h * G:(h + 1) * G, rows].float()  # [G, Q, D]
        s = (q @ key[0, h].float().T * scaling).masked_fill(~allowed, float("-inf"))
        w = torch.softmax(s, -1) ** 2  # [G, Q, n]
        m = torch.einsum("gqt,gqd,gqe->tde", w, q, q).double()
        tr = m.diagonal(dim1=1, dim2=2).sum(-1)
        out[h] = m / torch.where(tr > 0, tr, torch.ones_like(tr))[:, None, None]
    return out


def rope_matrices(layer: KverrLayer, lo: int, n: int, D: int) -> torch.Tensor:
    """``R [n, D, D]``: ``R[t] @ k`` is ``k`` rotated to position ``lo + t``."""
    cos, sin = layer._cos_sin(lo, lo + n)
    eye = torch.eye(D)[:, None, :].expand(D, n, D)  # [j, t, :] = e_j at every position
    out = rotate(eye, cos, sin)  # [j, t, i] = (R_t e_j)_i
    return out.permute(1, 2, 0).double()  # [t, i, j]


def compensated(w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, L: torch.Tensor, H: torch.Tensor,
                order: torch.Tensor) -> torch.Tensor:
    """GPTQ rounding of rows ``w [n, D]`` on per-element grids ``s, m [n, D]`` with ``L [D]``
    levels (0: the channel reads back ``m``), cost ``H [n, D, D]``; channels in ``order``."""
    w, s, m, H = w[:, order].double().clone(), s[:, order].double(), m[:, order].double(), H[:, order][:, :, order]
    L = L[order].double()
    D = w.shape[1]
    diag = H.diagonal(dim1=1, dim2=2)
    Hd = H + ON["damp"] * diag.mean(1)[:, None, None] * torch.eye(D, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True)
    q = torch.empty_like(w)
    for j in range(D):
        if L[j] == 0:
            q[:, j] = m[:, j]
        else:
            sj = torch.where(s[:, j] > 0, s[:, j], torch.ones_like(s[:, j]))
            q[:, j] = torch.round((w[:, j] - m[:, j]) / sj).clamp(0, float(L[j])) * s[:, j] + m[:, j]
        err = (w[:, j] - q[:, j]) / U[:, j, j]
        w[:, j + 1:] -= err[:, None] * U[:, j, j + 1:]
    out = torch.empty_like(q)
    out[:, order] = q
    return out


_observe, _quantize = KverrLayer.observe, KverrLayer._quantize


def observe(self, query, key, scaling, **kw):
    self._H = second_moment(query, self.n_kv_heads, ON["queries"])
    self._Ht = attention_moments(query, key, scaling, ON["queries"]) if ON["weight"] != "moment" else None
    if ON["weight"] == "relative":  # one matrix per kv head: the tokens' own, turned back to before RoPE, averaged
        n, D = query.shape[2], query.shape[3]
        R = rope_matrices(self, 0, n, D) if self.config.key_pre_rope else torch.eye(D, dtype=torch.float64).expand(n, D, D)
        lo = self.config.sinks
        self._Hrel = torch.stack([torch.einsum("tij,tik,tkl->jl", R[lo:], self._Ht[h, lo:].double(), R[lo:]) / (n - lo)
                                  for h in range(self._Ht.shape[0])])
        self._Ht = None
    return _observe(self, query, key, scaling, **kw)


def quantize(self, which, g, x):
    qt = _quantize(self, which, g, x)
    fmt = g.fmt
    if (which != "k" or not ON["gptq"] or fmt.dtype != "int" or fmt.is_float or not fmt.has_zero
            or not is_static(fmt.granularity) or getattr(fmt, "is_codebook", False) or x.shape[0] != 1):
        return qt
    B, h, n, D = x.shape
    lo = g.n_sinks + g.n_quantized
    R = rope_matrices(self, lo, n, D) if self.config.key_pre_rope else torch.eye(D, dtype=torch.float64).expand(n, D, D)
    A = hadamard_rotate(torch.eye(D)).double() if fmt.rotate == "hadamard" else None
    xr = hadamard_rotate(x.float()) if A is not None else x.float()
    s, m = qt.element_metadata()
    L = torch.tensor(fmt.channel_bits if fmt.channel_bits is not None else [fmt.bits] * D)
    L = torch.where(L > 0, 2 ** L - 1, torch.zeros_like(L))
    near = qt.dequantize(unrotate=False)
    u = torch.empty((B, h, n, D), dtype=torch.uint8)
    for i, head in enumerate(g.heads):
        Hp = self._H[head].expand(n, D, D)
        if ON["weight"] == "relative":  # already before RoPE
            Hp, R = self._Hrel[head].expand(n, D, D), torch.eye(D, dtype=torch.float64).expand(n, D, D)
        elif self._Ht is not None:  # attention-weighted for prompt tokens, plus mix x the queries' moment
            Hp = Hp / Hp[0].trace() * ON["mix"]
            k = max(0, min(n, self._Ht.shape[1] - lo))
            Hp = torch.cat([Hp[:k] + self._Ht[head, lo:lo + k].double(), self._H[head].expand(n - k, D, D)])
        Ht = torch.einsum("tij,tik,tkl->tjl", R, Hp, R)
        if A is not None:
            Ht = A.T @ Ht @ A
        order = torch.argsort(torch.where(L == 0, torch.full((D,), float("inf"), dtype=torch.float64),
                                          Ht.diagonal(dim1=1, dim2=2).mean(0)), descending=True)
        q = compensated(xr[0, i], s[0, i], m[0, i], L, Ht, order)
        for tag, y in ((0, near[0, i].double()), (1, q)):
            e = xr[0, i].double() - y
            COST[self.layer_idx][tag] += float(torch.einsum("td,tde,te->", e, Ht, e))
        sd = torch.where(s[0, i] > 0, s[0, i], torch.ones_like(s[0, i])).double()
        code = torch.clamp(torch.round((q - m[0, i].double()) / sd), min=0)
        u[0, i] = torch.minimum(code, L.double()).to(torch.uint8) * (L > 0)
    return QTensor(pack_codes(u, fmt).reshape(qt.codes.shape), qt.scale, qt.zero, fmt, qt.shape, qt.page_size)


KverrLayer.observe, KverrLayer._quantize = observe, quantize


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--queries", type=int, default=256, help="prompt queries whose second moment weighs the keys")
    ap.add_argument("--damp", type=float, default=0.01, help="damping, a fraction of the mean diagonal")
    ap.add_argument("--weight", choices=("moment", "attention", "relative"), default="moment",
                    help="moment: every key weighed by the prompt queries' second moment; attention: each prompt "
                         "token by sum_q a_qt^2 q q^T of the queries that read it (decode tokens: the moment); "
                         "relative: one matrix per kv head, the attention-weighted ones of the prompt's tokens turned back "
                         "to before RoPE and averaged, for every token")
    ap.add_argument("--mix", type=float, default=1.0,
                    help="with --weight attention: the share of the (trace-normalised) second moment added to each "
                         "prompt token's (trace-normalised) attention-weighted one")
    ap.add_argument("--skip-base", action="store_true", help="measure the compensated keys only")
    ap.add_argument("--refit", action="store_true",
                    help="refit the config's widths on each segment's prompt first (kverr evaluate --refit-widths)")
    a = ap.parse_args(argv)
    ON.update(queries=a.queries, damp=a.damp, weight=a.weight, mix=a.mix)
    if not CacheConfig.load(a.config).salient:
        raise SystemExit("the config keeps no salient tokens, so its cache never sees the prefill's queries")
    loaded, cfg, runs = protocol_runs(a)
    rows = []

    def switch(on: bool) -> None:
        ON["gptq"] = on
        COST.clear()

    for seg, off, on, measured in protocol_switch(loaded, cfg, runs, switch, refit=a.refit, skip_base=a.skip_base):
        name = "compensated" if on else "nearest"
        row = {"config": cfg.name + ("+refit" if a.refit else ""), "rounding": name, "segment": seg, "offset": off, "queries": a.queries,
               "damp": a.damp, "weight": a.weight, "mix": a.mix if a.weight == "attention" else None, **measured}
        if on:
            near, comp = sum(c[0] for c in COST.values()), sum(c[1] for c in COST.values())
            row.update(key_cost_nearest=near, key_cost_compensated=comp)
            print(f"  predicted key cost over the cache: compensated / nearest = {comp / near:.3f}; per layer "
                  + " ".join(f"{li}:{c[1] / c[0]:.2f}" for li, c in sorted(COST.items()) if c[0] > 0), flush=True)
        record(rows, row, a.out, f"{cfg.name} seg {seg} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
