"""Why the kernel path and the reference path disagree in a whole model, and what agrees exactly.

Runs kivi-2 (window 6, sinks 2) through KverrCache and through the Triton kernels (interpreter on
a CPU) in a random 3-layer Llama, in chunks of 20, 9, 1, 17, 1 and 12 tokens, and prints:
how far the keys/values each layer's cache receives differ between the paths, how many stored
elements differ, the log-prob difference; then the same with the reference's inputs forced into
the kernel path. Usage: python experiments/kernel-path-code-flips/flips.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pathlib  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from kverr.hf import KernelKVCache, cache_for  # noqa: E402
from kverr.capturing import float_environment, load_model  # noqa: E402
from kverr.capturing.tiny import make_tiny_model  # noqa: E402
from kverr.config import PRESETS  # noqa: E402
from kverr.hf import cache_kwarg  # noqa: E402


def run(model, cache, ids, chunks, record=None, force=None):
    calls: dict[int, int] = {}
    for i, layer in enumerate(cache.layers):
        def update(k, v, *a, _inner=layer.update, _i=i, **kw):
            n = calls[_i] = calls.get(_i, 0) + 1
            if force is not None:
                k, v = force[_i, n - 1]
            if record is not None:
                record[_i, n - 1] = (k.clone(), v.clone())
            return _inner(k, v, *a, **kw)
        layer.update = update
    out, t, kw = [], 0, cache_kwarg(model)
    with torch.no_grad():
        for n in chunks:
            out.append(torch.log_softmax(model(input_ids=ids[None, t:t + n], use_cache=True, **{kw: cache}).logits[0].float(), -1))
            t += n
    return torch.cat(out)


def main() -> None:
    model = load_model(str(make_tiny_model(pathlib.Path(tempfile.mkdtemp()) / "m", "llama"))).model
    L = model.config.num_hidden_layers
    cfg = PRESETS["kivi-2"].with_(window=6, sinks=2)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(5))
    chunks = [20, 9, 1, 17, 1, 12]
    print("numerics:", float_environment())
    rin, kin = {}, {}
    ref_cache = cache_for(model, cfg)
    ref = run(model, ref_cache, ids, chunks, record=rin)
    with KernelKVCache.for_model(model, cfg, max_tokens=64) as kc:
        got = run(model, kc, ids, chunks, record=kin)
        held = {(l, w): kc.paged.read(l, w, 0) for l in range(L) for w in "kv"}
    print("free-running: the inputs each layer's cache receives, max |kernel path - reference|")
    for l in range(L):
        dk = max(float((rin[l, c][0] - kin[l, c][0]).abs().max()) for c in range(len(chunks)))
        dv = max(float((rin[l, c][1] - kin[l, c][1]).abs().max()) for c in range(len(chunks)))
        nk = int((ref_cache.read(l, "k")[0] != held[l, "k"]).sum())
        nv = int((ref_cache.read(l, "v")[0] != held[l, "v"]).sum())
        print(f"  layer {l}: keys {dk:.2e}, values {dv:.2e}; stored elements that differ: keys {nk}, values {nv}")
    print(f"  log-probs: max |diff| {float((ref - got).abs().max()):.2e}")
    with KernelKVCache.for_model(model, cfg, max_tokens=64) as kc:
        forced = run(model, kc, ids, chunks, force=rin)
        n = sum(int((ref_cache.read(l, w)[0] != kc.paged.read(l, w, 0)).sum()) for l in range(L) for w in "kv")
    print("reference inputs forced into the kernel path:")
    print(f"  stored elements that differ: {n}; log-probs: max |diff| {float((ref - forced).abs().max()):.2e}")


if __name__ == "__main__":
    main()
