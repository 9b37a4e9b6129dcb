"""Experiment: an int8 window whose sink tokens stay fp16, on the reference path.

Configs whose name ends in ``-s16`` are evaluated with their sinks stored as fp16 rows (the window
and pending token blocks in the config's ``window_dtype``); every other config as it is. A patch of
``kverr.hf.reference.KverrLayer._append`` for this run only: the library has no such option. It asks
whether the int8 window's loss at 5 and 6.1 bits comes from rounding the attention sinks.

Usage (the arguments of ``kverr evaluate``)::

    python experiments/do-fp16-sinks-rescue-the-int8-window/fp16_sinks.py evaluate --text <lib>/argparse.py --segments 2 \\
        --config fp16win-5b.json --config int8win-5b.json --config int8win-5b-s16.json ...
"""
import sys

import kverr.hf.reference as kc
from kverr.quant.store import WindowRows

_append = kc.KverrLayer._append


def _append_fp16_sinks(self, which, x):
    if not (self.config.name or "").endswith("-s16"):
        return _append(self, which, x)
    for g in self.groups[which]:
        xs = x[:, g.heads].float()
        take = max(0, min(self.config.sinks - g.n_sinks, xs.shape[2]))
        if take:
            head = WindowRows.store(xs[:, :, :take], "fp16")
            g.sinks = head if g.sinks is None else g.sinks.cat(head)
        part = WindowRows.store(xs[:, :, take:], self.config.window_dtype)
        if part.n:
            g.pending = part if g.pending is None else g.pending.cat(part)


if __name__ == "__main__":
    kc.KverrLayer._append = _append_fp16_sinks
    from kverr.cli import main

    sys.exit(main(sys.argv[1:]))
