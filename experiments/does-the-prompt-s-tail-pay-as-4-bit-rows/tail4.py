"""Would the prompt's last tokens pay as 4-bit rows, twice as many for the bytes of int8 ones?

Kept as the int8 rows the window held, the prompt's last 4, 8, 16 or 32 tokens per (layer, kv
head) take 11, 15, 23 and 32 % off ``windows-3b``'s held-out KL
(``../does-the-prompt-s-tail-pay-as-int8-rows/``): the first decode steps read them most. A row of
``--row-bits`` integers per token (asymmetric, one fp16 scale and zero per token and head, after a
Hadamard rotation with ``--rotate hadamard``) costs about half an int8 row at 4 bits. Per segment
(typing.py, P = 1024, N = 256 teacher-forced steps, as ``kverr evaluate``): the config with the
last ``k`` prompt tokens of every (layer, kv head) kept as such rows on ``--sides`` (beside their
codes, as salient tokens are), rounded from the int8 row the window held, for each ``--keep``.

Each row's ``bits``: the config's effective bits at ``--context`` tokens (static bytes shared by
``--batch`` sequences, the prompt quantized whole) plus the kept rows (``decode_salient.row_bits``).

Usage (from the repository root): PYTHONPATH=. python experiments/does-the-prompt-s-tail-pay-as-4-bit-rows/tail4.py
    CONFIG OUT.csv [--segments 0] [--keep 0 16 32] [--row-bits 4] [--rotate hadamard] [--sides kv]
    [--compensated-keys] [--refit]
"""
from __future__ import annotations

from bench.heldout import experiment_script, protocol_parser, protocol_switch, record
from kverr.memory import model_shape
from kverr.quant.formats import PerToken, int_format
from kverr.quant.reference import codes_nbytes, fake_quantize

tail = experiment_script("does-the-prompt-s-tail-pay-as-int8-rows", "tail.py")
decode_salient = tail.decode_salient  # one instance: its patches of the cache read its KEEP, SAVED and ROW


def row_format(bits: int, rotate: str):
    """The kept rows' format: ``bits``-bit integers per (token, head), asymmetric, fp16 scale and zero."""
    return int_format(bits, PerToken(), symmetric=False, scale_dtype="fp16", rotate=rotate)


def row_bytes(fmt) -> int:
    """Bytes of one kept row in ``fmt``: its codes, scale and zero."""
    return codes_nbytes(fmt, model_shape("default").head_dim) + fmt.scale_bytes * (2 if fmt.has_zero else 1)


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--keep", type=int, nargs="+", default=[0, 16], help="prompt tokens kept, a run each")
    ap.add_argument("--row-bits", type=int, default=4, help="bits of the kept rows' integers")
    ap.add_argument("--rotate", choices=("none", "hadamard"), default="hadamard", help="rows rotated before rounding")
    ap.add_argument("--sides", choices=("kv", "k", "v"), default="kv", help="which sides keep the rows")
    a, loaded, cfg, runs, base, name = decode_salient.kept_rows_protocol(ap, argv)
    fmt = row_format(a.row_bits, a.rotate)

    # [B, D] as the window held it -> as a kept row reads back; a side without rows reads its codes
    decode_salient.ROW = lambda which, row: (fake_quantize(row[:, None, None, :], fmt)[:, 0, 0, :]
                                             if which in a.sides else None)

    rows = []
    runs, switch = tail.tail_switch(loaded, runs)
    for seg, off, k, measured in protocol_switch(loaded, cfg, runs, switch, refit=a.refit, settings=a.keep):
        bits = base + decode_salient.row_bits(k, a.context, row_bytes(fmt), len(a.sides))
        row = {"config": name, "segment": seg, "offset": off, "keep": k, "row_bits": a.row_bits,
               "rotate": a.rotate, "sides": a.sides, "bits": bits, **measured}
        record(rows, row, a.out, f"{name} seg {seg} the last {k} prompt tokens as {a.row_bits}-bit rows on "
                                 f"{a.sides} ({row['bits']:.4f} bits)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
