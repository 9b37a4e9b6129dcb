"""Benchmark: scoring a layer's candidates with the sampled queries in causal blocks.

The calibration objective computes, for every candidate format and outer option, the key and
value terms of each sampled query over the capture's tokens. A query sees only the tokens before
it, so the terms of the later tokens are zero: :func:`kverr.calibration.objective.query_blocks`
splits the queries (in position order) into blocks of ``QUERY_BLOCK`` that each compute over the
tokens up to their last query only. This times one layer's scoring
(:func:`kverr.calibration.search._score_block`, what each calibration task runs) both ways in the
same run -- all queries in one block over every token, as before, against the library's blocks --
and compares the damage tables:

- both times and their ratio;
- the largest relative difference of a table entry (the blocks group the float32 sums otherwise);
- how many (option, kv head, K|V) rankings of the candidates differ between the two.

The layer is scored as ``kverr calibrate --candidates fitted --codebooks --salient 8
--salient-recent 8 --window-per-head --queries N`` scores it (int8 windows), keys rounded to
nearest: compensated rounding adds the same work to both.

Usage::

    python -m bench.run query_blocks            # 4096-token capture, 512 queries, layer 10
    python -m bench.run query_blocks --quick    # 1024 tokens, 128 queries
"""

from __future__ import annotations

import time


def _score(capture, layer: int, queries: int):
    """``_score_block`` of one layer with the calibration's settings; ``(dk, dv, seconds)``."""
    import numpy as np

    from kverr.calibration import CalibrationConfig
    from kverr.calibration import search as S

    cfg = CalibrationConfig(budgets=(3.0,), candidates="fitted", codebooks=True, salient=8, salient_recent=8,
                            queries=queries, window_per_head=True)
    options = S.calibration_options(capture, cfg)
    wdt, cands = S._search_key(cfg, 3.0)
    ck, cv = S._search_candidates(cfg, cands, capture.kv.head_dim)
    kv, sl = capture.kv, {"layer": slice(layer, layer + 1)}
    arrays = [capture[n].isel(**sl).values for n in ("q", "k", "v", "k_pre", "layer")]
    extra = [x.isel(**sl).values for x in (kv.attn_scales(), kv.sliding_windows(), kv.attn_sinks())]
    t0 = time.perf_counter()
    dk, dv, *_ = S._score_block(*arrays, *extra, kv_map=kv.kv_head_of_q, positions=kv.positions, rope=kv.rope,
                                cands_k=ck, cands_v=cv, options=options, queries=queries, page_size=64,
                                window_dtype=wdt, decode=None)
    return np.asarray(dk), np.asarray(dv), time.perf_counter() - t0


def _rankings_differing(a, b) -> int:
    """(option, kv head) pairs of ``[layer, option, cand, kv_head]`` tables whose candidate order differs."""
    import numpy as np

    oa, ob = np.argsort(a, axis=2, kind="stable"), np.argsort(b, axis=2, kind="stable")
    return int((oa != ob).any(axis=2).sum())


def measure(quick: bool) -> list:
    """Registry entry: one layer scored with its queries in one block and in the library's blocks."""
    import numpy as np
    import torch

    from bench.common import Row, pydoc_capture
    from kverr.calibration import objective
    from kverr.io import open_capture

    torch.set_num_threads(1)
    tokens, queries, layer = (1024, 128, 10) if quick else (4096, 512, 10)
    capture = open_capture(pydoc_capture(tokens))
    block = objective.QUERY_BLOCK
    try:
        objective.QUERY_BLOCK = queries  # one block over every token: the computation before blocks
        k1, v1, whole = _score(capture, layer, queries)
    finally:
        objective.QUERY_BLOCK = block
    kb, vb, blocked = _score(capture, layer, queries)
    rel = max(float(np.max(np.abs(kb - k1) / np.abs(k1))), float(np.max(np.abs(vb - v1) / np.abs(v1))))
    changed = _rankings_differing(k1, kb) + _rankings_differing(v1, vb)
    case = f"layer {layer} of {tokens} tokens, {queries} queries, blocks of {block}"
    print(f"{case}: one block {whole:.1f} s, blocks {blocked:.1f} s ({whole / blocked:.2f}x); "
          f"max relative table difference {rel:.1e}; {changed} rankings differ", flush=True)
    return [Row(case, "one_block_s", whole, "s"), Row(case, "blocks_s", blocked, "s"),
            Row(case, "speedup", whole / blocked, "x"), Row(case, "max_rel_diff", rel, "ratio"),
            Row(case, "rankings_differing", changed, "count")]


if __name__ == "__main__":
    measure(quick=False)
