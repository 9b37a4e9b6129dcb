"""Today's KV-cache methods from their papers, emulated as evaluation peers (not kverr formats).

Each module restates one method's cache as its paper (and, where public, its code) describes it,
as a transformers cache for ``kverr evaluate --scheme NAME`` beside kverr's configs, and says what
it takes from the source and what it chooses where the source is silent. They are registered
with the engines' emulated dtypes in :mod:`kverr.engines.emulated`; methods fitted offline take
the calibration capture (``kverr evaluate --calibration``).

* :mod:`kverr.peers.turboquant` -- TurboQuant's MSE quantizer with outlier channels a bit wider
  (2.5 and 3.5 bits of codes);
* :mod:`kverr.peers.oscar` -- OSCAR: attention-aware rotations fitted offline, clipped INT2 per
  token, bf16 sink and recent tokens;
* :mod:`kverr.peers.kvquant` -- KVQuant: pre-RoPE per-channel keys, per-token values, per-layer
  non-uniform levels fitted offline, 1 % sparse outliers, the first token in fp16.
"""
