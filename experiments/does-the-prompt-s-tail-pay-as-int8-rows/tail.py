"""Would the prompt's last tokens, kept as the int8 rows the window held, pay for their bytes?

The held-out protocol quantizes the prompt whole after the prefill, so the first decode steps
read the tokens just before them -- the ones local heads attend to most -- through their codes,
and the first 64 of 256 steps carry about 40 % of a 3-bit config's KL
(``../does-the-decode-carry-the-error-forward/``). Per segment (typing.py, P = 1024, N = 256
teacher-forced steps, as ``kverr evaluate``): the config with the last ``k`` prompt tokens of
every (layer, kv head) kept, both keys and values, as the int8 rows the window held (beside their
codes, as salient tokens are), for each ``--keep``.

Each row's ``bits``: the config's effective bits at ``--context`` tokens (static bytes shared by
``--batch`` sequences, the prompt quantized whole) plus the kept rows, counted as salient rows
are (``decode_salient.row_bits``).

Usage (from the repository root): PYTHONPATH=. python experiments/does-the-prompt-s-tail-pay-as-int8-rows/tail.py
    CONFIG OUT.csv [--segments 0] [--keep 0 16 32] [--compensated-keys] [--refit]
"""
from __future__ import annotations

import torch

from bench.heldout import experiment_script, protocol_parser, protocol_switch, record

# keeps the int8 rows of the positions in its KEEP (per layer, [kv head, k]) as they are quantized
decode_salient = experiment_script("where-does-the-held-out-kl-come-from", "decode_salient.py")


def tail_switch(loaded, runs):
    """``(runs, switch)`` for :func:`bench.heldout.protocol_switch`: the segments' runs, noting each
    prompt's length, and a switch keeping the last ``k`` prompt tokens of every (layer, kv head)
    (``decode_salient.KEEP``; none for ``k = 0``)."""
    n_layers, n_kv = loaded.model.config.num_hidden_layers, loaded.model.config.num_key_value_heads
    now: dict = {}

    def with_prefill(runs):
        for p, *rest in runs:
            now["p"] = p
            yield (p, *rest)

    def switch(k):
        decode_salient.KEEP.clear()
        decode_salient.SAVED.clear()
        if k:
            tail = torch.arange(now["p"] - k, now["p"])
            for li in range(n_layers):
                decode_salient.KEEP[li] = tail.expand(n_kv, k)

    return with_prefill(runs), switch


def main(argv=None) -> int:
    ap = protocol_parser(__doc__)
    ap.add_argument("--keep", type=int, nargs="+", default=[0, 16], help="prompt tokens kept, a run each")
    a, loaded, cfg, runs, base, name = decode_salient.kept_rows_protocol(ap, argv)
    runs, switch = tail_switch(loaded, runs)
    rows = []
    for seg, off, k, measured in protocol_switch(loaded, cfg, runs, switch, refit=a.refit, settings=a.keep):
        row = {"config": name, "segment": seg, "offset": off, "keep": k,
               "bits": base + decode_salient.row_bits(k, a.context), **measured}
        record(rows, row, a.out, f"{name} seg {seg} keep the last {k} prompt tokens ({row['bits']:.4f} bits)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
