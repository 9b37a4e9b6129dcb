"""Measured layer sensitivity: next-token KL per unit of relative squared attention-output error.

The calibration objective (:mod:`.objective`) predicts, per layer and side, a *relative* squared
error of the attention output before ``o_proj``, ``r_l = mean ‖δo‖² / mean ‖o‖²`` (the key term
``(a′ − a)V`` for key errors, the value term ``a·E_V`` for value errors). Layers do not matter
equally to the model's output: the same ``r_l`` in one layer can cost far more next-token KL than
in another. :func:`measure_sensitivity` measures that with the real model on the calibration
text, with noise in one of two places (``noise=``):

The protocol mirrors the evaluation (a cache written over a prompt, then decode steps that read
it): of ``T`` tokens of calibration text, the first ``P = T - N`` are the prompt and the last
``N`` ("noisy") positions are where the error acts.

1. a clean forward over the ``T`` tokens records the residual stream entering every layer and the
   ``o_proj`` input ``o`` at the noisy positions (mean squared norm ``m_l = mean_t ‖o_t‖²``), and
   the clean next-token log-probabilities; a cache of the prompt is filled;
2. for each layer ``l``, fixed Gaussian noise (seeded per layer) is added, and layers ``l..`` are
   run again on the noisy positions only, over the prompt's cache, for two sizes ``ε₁ < ε₂`` in
   one batch:

   * ``"o_proj"`` (the default): ``δ = ε·sqrt(m_l / n)·z`` is added to the ``o_proj`` input at the
     noisy positions (``n`` its width, so ``E‖δ_t‖² = ε² m_l``: a relative squared error
     ``r = ε²``). One weight per layer, for key and value errors alike.
   * ``"kv"``: noise isotropic within each kv head, of relative RMS ``ε`` of that head's cached
     prompt keys -- in a second run, values -- is added to layer ``l``'s cache (all but the first
     ``sinks`` tokens, full precision in the configs searched), and ``r`` is the relative squared
     error of the ``o_proj`` input it caused. A key error moves the output along the values the
     head already attends to, a value error in any direction: on the default model the key
     weights come out 1–3× the value weights in most layers, which the ``o_proj`` noise cannot
     see (README, "Calibrate"). Four runs per layer instead of two.
3. ``KL_l = mean_t KL(p_clean,t ‖ p_noisy,t)`` over up to ``kl_positions`` evenly spaced noisy
   positions, and ``w_l = KL_l(ε₁) / r_l(ε₁)`` in nats per unit of relative squared error.

:attr:`Sensitivity.quadratic_ratio` reports ``(KL/r)(ε₂) / (KL/r)(ε₁)`` per site and layer (1
where KL is linear in ``r``: quadratic in ``ε``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kverr.exceptions import CaptureError, ConfigError

log = logging.getLogger(__name__)

#: Default noise sizes (relative RMS of the cached keys or values; on the default model KL is
#: linear in the error they cause: quadratic ratios 0.86 .. 1.08).
DEFAULT_EPS = (0.05, 0.1)
#: Clean prefix + noisy positions (512 + 128 tokens by default).
DEFAULT_TOKENS = 640
DEFAULT_NOISY = 128
DEFAULT_KL_POSITIONS = 128


#: Where :func:`measure_sensitivity` adds noise -> the sites of a :class:`Sensitivity`'s arrays.
NOISE_SITES = {"o_proj": ("o_proj",), "kv": ("k", "v")}
#: Provenance description of each measurement.
METHODS = {
    "o_proj": "gaussian noise of relative RMS eps added to one layer's o_proj input at the last `noisy` "
              "of `tokens` positions (clean prefix before); w = mean next-token KL / eps1^2 (nats per "
              "unit relative squared attention-output error), the same for keys and values",
    "kv": "isotropic gaussian noise of relative RMS eps (per kv head) added to one layer's cached "
          "prompt keys, or values (the first tokens - noisy tokens, sinks excepted), read by the last "
          "`noisy` positions; w = mean next-token KL / r, r = the relative squared error of that layer's "
          "o_proj input the noise caused (nats per unit relative squared attention-output error), per side",
    "given": "weights given (Sensitivity.uniform), not measured",
}


@dataclass
class Sensitivity:
    """Per-layer sensitivity of next-token KL to relative attention-output error, per side.

    Attributes
    ----------
    weights_k, weights_v : ndarray ``[layer]``
        ``w_l = KL_l(ε₁) / r_l(ε₁)`` for key errors and for value errors (nats per unit relative
        squared error of the ``o_proj`` input); equal with ``noise="o_proj"``.
    kl : ndarray ``[site, layer, eps]``
        Measured mean KL per noise site (:data:`NOISE_SITES`).
    rel : ndarray ``[site, layer, eps]``
        The relative squared ``o_proj``-input error of each run (``ε²`` by construction for
        ``o_proj`` noise, measured for ``kv`` noise).
    noise : str
        ``"o_proj"`` or ``"kv"`` (``"given"``: :meth:`uniform`).
    eps : tuple of float
        Noise sizes ``ε₁ < ε₂`` (relative RMS of what the noise is added to).
    tokens : int
        Tokens of calibration text the model ran on (the first ``tokens`` of the capture).
    noisy : int
        The last ``noisy`` of them read the noisy cache of the others.
    kl_positions : int
        Positions at which KL was measured.
    sinks : int
        The first ``sinks`` prompt tokens got no noise.
    """

    weights_k: np.ndarray
    weights_v: np.ndarray
    kl: np.ndarray
    rel: np.ndarray
    eps: tuple[float, ...]
    tokens: int
    noisy: int
    kl_positions: int
    noise: str = "o_proj"
    sinks: int = 0
    seed: int = 0
    seconds: float = 0.0
    model_id: str = ""
    weights_sha256: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def uniform(cls, weights: Sequence[float], weights_v: Sequence[float] | None = None, **kw: Any) -> Sensitivity:
        """A sensitivity with given weights (values: ``weights_v``, else the same), e.g. to
        calibrate with weights measured elsewhere; ``kl`` and ``rel`` are then NaN (``null`` in
        :meth:`to_dict`)."""
        wk = np.asarray(weights, dtype=np.float64)
        wv = wk if weights_v is None else np.asarray(weights_v, dtype=np.float64)
        nan = np.full((1, wk.shape[0], 2), np.nan)
        kw = {"eps": DEFAULT_EPS, "tokens": 0, "noisy": 0, "kl_positions": 0, "noise": "given", **kw}
        return cls(weights_k=wk, weights_v=wv, kl=nan, rel=nan.copy(), **kw)

    @classmethod
    def mean(cls, measured: Sequence[Sensitivity]) -> Sensitivity:
        """The sensitivity of several captures measured alike: the layer weights, KL and relative
        errors averaged with the captures counting alike (:meth:`Scores.mean
        <kverr.calibration.search.Scores.mean>`'s rule); ``extra["captures"]`` says how many, and
        ``tokens`` is the first's (a capture shorter than the tokens asked for gives fewer)."""
        measured = list(measured)
        if not measured:
            raise ConfigError("give at least one capture's sensitivity to average")
        first = measured[0]
        if len(measured) == 1:
            return first
        same = ("noise", "eps", "noisy", "kl_positions", "sinks", "seed", "weights_sha256")
        for m in measured[1:]:
            differ = [n for n in same if getattr(m, n) != getattr(first, n)]
            if differ or m.kl.shape != first.kl.shape or m.weights_k.shape != first.weights_k.shape:
                raise ConfigError(f"sensitivities averaged over captures must be measured alike; these differ in "
                                  f"{', '.join(differ) or 'their shapes'}")
        avg = lambda name: np.mean([getattr(m, name) for m in measured], axis=0)  # noqa: E731
        return replace(first, weights_k=avg("weights_k"), weights_v=avg("weights_v"), kl=avg("kl"), rel=avg("rel"),
                       seconds=float(sum(m.seconds for m in measured)), extra={**first.extra, "captures": len(measured)})

    @property
    def quadratic_ratio(self) -> np.ndarray:
        """``[site, layer]``: ``(KL/r)(ε₂) / (KL/r)(ε₁)``, 1 where KL is linear in ``r``."""
        w = self.kl / np.where(self.rel > 0, self.rel, np.nan)
        return w[..., -1] / np.where(w[..., 0] > 0, w[..., 0], np.nan)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record for a config's provenance."""
        def f(a):  # nested lists of floats, NaN as None (strict JSON)
            a = np.asarray(a, dtype=np.float64)
            return np.where(np.isfinite(a), a, None).tolist()

        return {
            "method": METHODS[self.noise],
            "noise": self.noise,
            "tokens": int(self.tokens),
            "noisy": int(self.noisy),
            "kl_positions": int(self.kl_positions),
            "sinks": int(self.sinks),
            "eps": [float(e) for e in self.eps],
            "seed": int(self.seed),
            "weights_k": f(self.weights_k),
            "weights_v": f(self.weights_v),
            "kl": f(self.kl),
            "rel": f(self.rel),
            "quadratic_ratio": f(self.quadratic_ratio),
            **({"captures": int(self.extra["captures"])} if "captures" in self.extra else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sensitivity:
        """Read :meth:`to_dict`'s record, or an earlier one (``o_proj`` noise: one ``weights`` per
        layer and ``kl [layer, eps]``)."""
        meta = dict(tokens=int(d["tokens"]), noisy=int(d["noisy"]), kl_positions=int(d["kl_positions"]),
                    noise=str(d.get("noise", "o_proj")), sinks=int(d.get("sinks", 0)), seed=int(d.get("seed", 0)),
                    seconds=float(d.get("seconds", 0.0)), eps=tuple(float(e) for e in d["eps"]),
                    extra={"captures": int(d["captures"])} if "captures" in d else {})
        arr = lambda k: np.asarray(d[k], dtype=np.float64)  # noqa: E731  (None -> NaN)
        if "weights_k" not in d:
            kl = arr("kl")[None]
            rel = np.broadcast_to(np.square(meta["eps"]), kl.shape).copy()
            return cls(weights_k=arr("weights"), weights_v=arr("weights"), kl=kl, rel=rel, **meta)
        return cls(weights_k=arr("weights_k"), weights_v=arr("weights_v"), kl=arr("kl"), rel=arr("rel"), **meta)


def _parts(model: Any):
    """``(base model, decoder layers, final norm, lm head)`` of a Llama-family causal LM."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or layers is None or head is None or not hasattr(base, "norm"):
        raise ConfigError(
            f"cannot measure layer sensitivity of a {type(model).__name__}: expected a causal LM "
            "with .model.layers, .model.norm and an output embedding (Llama, Mistral, Qwen2/3)"
        )
    return base, layers, base.norm, head


class _Runner:
    """Runs a decoder's layers ``start..`` on the suffix ``[P, T)`` of the tokens, over a cache
    that holds the clean prefix ``[0, P)`` (a perturbed run repeats no clean work).

    Each layer gets the mask and the rotary embedding of its attention type, as the model's own
    forward gives them (sliding-window layers: a sliding-window mask; models with a RoPE per
    layer type: that type's). The cache keeps every prefix token of every layer (no sliding
    layers that drop old tokens): the masks hide what a window does not see.
    """

    def __init__(self, model: Any, ids: torch.Tensor, prefix: int):
        import inspect

        from kverr.memory import sliding_windows_of

        self.base, self.layers, self.norm, self.head = _parts(model)
        self.config = self.base.config
        windows = sliding_windows_of(self.config.to_dict(), len(self.layers), type(model).__name__)
        self.types = ["sliding_attention" if w else "full_attention" for w in (windows or [0] * len(self.layers))]
        self.ids, self.P, self.T = ids, int(prefix), int(ids.shape[-1])
        self.pos_all = torch.arange(self.T)[None]
        self.pos_suf = self.pos_all[:, self.P:]
        self.emb = self.base.embed_tokens(ids[None])
        per_type = "layer_type" in inspect.signature(self.base.rotary_emb.forward).parameters
        self.pe_all = {t: (self.base.rotary_emb(self.emb, position_ids=self.pos_all, layer_type=t) if per_type
                           else self.base.rotary_emb(self.emb, position_ids=self.pos_all))
                       for t in set(self.types)}
        self.cache = None

    def _masks(self, h: torch.Tensor, cache: Any, pos: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        fns = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {t: fns[t](config=self.config, inputs_embeds=h, attention_mask=None, cache=cache, position_ids=pos)
                for t in set(self.types)}

    def _pe(self, lo: int, hi: int, batch: int = 1) -> dict[str, tuple[torch.Tensor, ...]]:
        """Each type's rotary embedding ``(cos, sin)``, ``[batch, hi − lo, ·]``, of positions lo..hi."""
        return {t: tuple(x[:, lo:hi].expand(batch, *x[:, lo:hi].shape[1:]) for x in pe)
                for t, pe in self.pe_all.items()}

    def clean(self, record: list) -> torch.Tensor:
        """Clean forward over all tokens; ``record`` gets each layer's input at ``[P, T)``."""
        masks = self._masks(self.emb, None, self.pos_all)
        h = self.emb
        for layer, t in zip(self.layers, self.types):
            record.append(h[:, self.P:])
            h = layer(h, attention_mask=masks[t], position_embeddings=self.pe_all[t], position_ids=self.pos_all)
        return h[:, self.P:]

    def fill_prefix(self, batch: int) -> None:
        from transformers import DynamicCache

        cache = DynamicCache()
        h = self.emb[:, :self.P]
        pos = self.pos_all[:, :self.P]
        pe = self._pe(0, self.P)
        masks = self._masks(h, cache, pos)
        for layer, t in zip(self.layers, self.types):
            h = layer(h, attention_mask=masks[t], position_embeddings=pe[t], position_ids=pos, cache=cache,
                      use_cache=True)
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        self.cache = cache

    def run(self, h: torch.Tensor, start: int) -> torch.Tensor:
        """Layers ``start..`` on suffix inputs ``h [B, T-P, hidden]``; the cache is restored."""
        B = h.shape[0]
        pe = self._pe(self.P, self.T, B)
        masks = self._masks(h, self.cache, self.pos_suf)
        try:
            for i in range(start, len(self.layers)):
                t = self.types[i]
                h = self.layers[i](h, attention_mask=masks[t], position_embeddings=pe[t], position_ids=self.pos_suf,
                                   cache=self.cache, use_cache=True)
        finally:
            # drop what this run appended (layers before ``start`` were not touched)
            for lay in self.cache.layers[start:]:
                lay.keys, lay.values = lay.keys[..., :self.P, :], lay.values[..., :self.P, :]
        return h

    def logp(self, h: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """``[B, len(sel), vocab]`` float64 log-probabilities at suffix positions ``sel``."""
        return torch.log_softmax(self.head(self.norm(h[:, sel])).double(), -1)


def measure_sensitivity(
    model: Any,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    noisy: int = DEFAULT_NOISY,
    eps: Sequence[float] = DEFAULT_EPS,
    kl_positions: int = DEFAULT_KL_POSITIONS,
    noise: str = "o_proj",
    sinks: int = 0,
    seed: int = 0,
    threads: int = 1,
    progress: bool = False,
) -> Sensitivity:
    """Measure the sensitivity of every layer by noise injection (see the module docstring).

    Parameters
    ----------
    model : transformers causal LM (or :class:`kverr.capturing.LoadedModel`)
        The model the calibration capture came from.
    token_ids : array ``[token]``
        Calibration text (the capture's ``token_id``), ``T`` tokens.
    noisy : int
        The last ``noisy`` positions get noise (``P = T - noisy`` clean prefix tokens).
    eps : two floats
        Relative noise sizes ``ε₁ < ε₂``; ``w`` uses ``ε₁``, the pair checks the quadratic regime.
    kl_positions : int
        At most this many evenly spaced noisy positions at which KL is measured.
    noise : {"o_proj", "kv"}
        Where the noise goes (module docstring): the ``o_proj`` input (one weight per layer), or the
        cached prompt keys and, separately, values (a weight per layer and side).
    sinks : int
        ``noise="kv"``: the first ``sinks`` prompt tokens get no noise (a config's full-precision
        sink tokens: they draw much of the attention, and their errors would dominate ``r`` in
        later layers).
    threads : int
        torch threads used (restored afterwards).
    """
    from kverr.progress import progress as progress_bar

    loaded = None
    if hasattr(model, "weights_sha256") and hasattr(model, "model"):
        loaded, model = model, model.model
    eps = tuple(float(e) for e in eps)
    if len(eps) != 2 or not all(math.isfinite(e) and e > 0 for e in eps) or not eps[0] < eps[1]:
        raise ConfigError(f"eps={eps!r}: give two noise sizes 0 < eps1 < eps2")
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long).flatten()
    T = int(ids.numel())
    if not 1 <= noisy < T:
        raise ConfigError(f"noisy={noisy} must lie in 1..{T - 1} (the text has {T} tokens)")
    if kl_positions < 1:
        raise ConfigError(f"kl_positions={kl_positions} must be positive")
    if noise not in NOISE_SITES:
        raise ConfigError(f"noise={noise!r} is not known; use one of {', '.join(NOISE_SITES)}")
    if not 0 <= sinks < T - noisy:
        raise ConfigError(f"sinks={sinks} must lie in 0..{T - noisy - 1} (the prompt has {T - noisy} tokens)")
    t0 = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        with torch.no_grad():
            r = _Runner(model, ids, T - noisy)
            L = len(r.layers)
            sel = torch.as_tensor(np.unique(np.linspace(0, noisy - 1, min(kl_positions, noisy))
                                            .round().astype(np.int64)))
            # clean pass: each layer's input and o_proj input at the noisy positions
            o_clean: list[torch.Tensor | None] = [None] * L
            hooks = []
            for i, layer in enumerate(r.layers):
                def pre(_m, args, i=i):
                    o_clean[i] = args[0][:, r.P:].detach().clone()
                hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(pre))
            hs: list[torch.Tensor] = []
            try:
                h = r.clean(hs)
            finally:
                for hk in hooks:
                    hk.remove()
            ref = r.logp(h, sel)[0]  # [n, V]
            p_ref = ref.exp()
            ne = len(eps)
            sites = len(NOISE_SITES[noise])
            r.fill_prefix(sites * ne)  # batch: site 0 at eps_1, eps_2, then site 1 (kv: keys, values)
            e = torch.tensor(eps, dtype=torch.float32)
            kl = np.zeros((sites, L, ne))
            rel = np.zeros((sites, L, ne))
            for i in progress_bar(range(L), desc="calibrate: layer sensitivity", unit="layer", enabled=progress):
                oc = o_clean[i].double()  # [1, N, n]
                msq = float((oc ** 2).sum(-1).mean())
                g = torch.Generator().manual_seed(int(seed) * 1_000_003 + i)
                o_proj = r.layers[i].self_attn.o_proj
                got: dict[str, torch.Tensor] = {}
                lay = r.cache.layers[i]
                k0, v0 = lay.keys, lay.values  # [sites*ne, kv, P, D], the batch copies equal
                if noise == "o_proj":
                    n = o_proj.in_features
                    z = torch.randn((noisy, n), generator=g).mul_(math.sqrt(msq / n))

                    def hook(_m, args, z=z):
                        return (args[0] + e[:, None, None] * z[None], *args[1:])
                else:
                    add = []
                    for x in (k0[0], v0[0]):
                        z = torch.randn(x.shape, generator=g, dtype=torch.float32)
                        z[:, :sinks] = 0  # sink tokens stay unquantized
                        rms = x.float().pow(2).mean((-2, -1), keepdim=True).sqrt()  # per kv head
                        add.append((e[:, None, None, None] * (z * rms)[None]).to(x.dtype))
                    zero = torch.zeros_like(add[0])
                    lay.keys = k0 + torch.cat([add[0], zero])
                    lay.values = v0 + torch.cat([zero, add[1]])

                    def hook(_m, args, got=got):
                        got["o"] = args[0].detach()

                hk = o_proj.register_forward_pre_hook(hook)
                try:
                    hb = r.run(hs[i].expand(sites * ne, -1, -1), i)
                finally:
                    hk.remove()
                    lay.keys, lay.values = k0, v0
                lp = r.logp(hb, sel)  # [sites*ne, n, V]
                kl[:, i] = (p_ref[None] * (ref[None] - lp)).sum(-1).clamp(min=0).mean(-1).numpy().reshape(sites, ne)
                if noise == "o_proj":
                    rel[:, i] = np.square(eps)  # E||delta||^2 = eps^2 m_l by construction
                else:
                    err = ((got["o"].double() - oc) ** 2).sum(-1).mean(-1) / (msq if msq > 0 else 1.0)
                    rel[:, i] = err.numpy().reshape(sites, ne)
    finally:
        torch.set_num_threads(old_threads)
    w = kl[:, :, 0] / np.where(rel[:, :, 0] > 0, rel[:, :, 0], np.inf)
    sens = Sensitivity(weights_k=w[0], weights_v=w[-1], kl=kl, rel=rel, eps=eps, tokens=T, noisy=int(noisy),
                       kl_positions=int(sel.numel()), noise=noise, sinks=int(sinks), seed=int(seed),
                       seconds=time.perf_counter() - t0,
                       model_id=getattr(loaded, "model_id", ""), weights_sha256=getattr(loaded, "weights_sha256", ""))
    log.info("layer sensitivity (%s noise) on %d tokens in %.1f s: keys %.3g..%.3g, values %.3g..%.3g nats",
             noise, T, sens.seconds, w[0].min(), w[0].max(), w[-1].min(), w[-1].max())
    return sens


def model_spec_of_capture(capture: Any) -> str:
    """The :func:`kverr.capturing.load_model` spec that loads the model a capture came from."""
    from pathlib import Path

    import kverr.accessor  # noqa: F401  (registers ds.kv)
    from kverr.capturing.model import DEFAULT_MODEL_ID

    mid = capture.kv.provenance["model_id"]
    if mid == DEFAULT_MODEL_ID:
        return "default"
    if mid and Path(mid).is_dir():
        return mid
    raise CaptureError(
        f"the capture names its model {mid!r}, which is neither the default model nor a local "
        "model directory; pass the model with --model (or use --objective rel)"
    )


def check_capture_model(capture: Any, model: Any = None) -> Any:
    """The capture's model, loaded (``model``: ``None`` for the one the capture names, a
    :func:`kverr.capturing.load_model` spec, or a LoadedModel), after checking by weights sha256
    that it IS the model the capture was made with; :class:`CaptureError` otherwise."""
    import kverr.accessor  # noqa: F401  (registers ds.kv)

    if "token_id" not in capture:
        raise CaptureError("the capture has no token_id: recapture it to measure layer sensitivity")
    recorded = capture.kv.provenance
    want = recorded["weights_sha256"]
    if not want:
        raise CaptureError("the capture does not record its model's weights sha256; recapture it "
                           "or calibrate with --objective rel")
    if model is None or isinstance(model, str):
        from kverr.capturing import load_model

        model = load_model(model or model_spec_of_capture(capture))
    got = str(getattr(model, "weights_sha256", ""))
    if got != want:
        raise CaptureError(
            f"the capture was made with {recorded['model_id']!r} (weights sha256 "
            f"{want[:12]}...), not with the model given ({getattr(model, 'model_id', '?')!r}, "
            f"{got[:12]}...); calibrate with the capture's own model"
        )
    n_layers = capture.kv.n_layers
    if getattr(model, "n_layers", n_layers) != n_layers:
        raise CaptureError(f"the capture's model has {n_layers} layers, the model given {model.n_layers}")
    return model


def sensitivity_for_capture(capture: Any, *, model: Any = None, tokens: int = DEFAULT_TOKENS,
                            noisy: int = DEFAULT_NOISY, eps: Sequence[float] = DEFAULT_EPS,
                            kl_positions: int = DEFAULT_KL_POSITIONS, noise: str = "o_proj", sinks: int = 0,
                            seed: int = 0, threads: int = 1, progress: bool = False) -> Sensitivity:
    """Measure the sensitivity of the capture's model (see :func:`check_capture_model` for
    ``model``) on the capture's first ``tokens`` token ids."""
    model = check_capture_model(capture, model)
    n = min(int(tokens), int(capture.sizes["token"]))
    if n <= noisy:
        raise CaptureError(f"the capture has {n} tokens; layer sensitivity needs more than noisy={noisy}")
    ids = np.asarray(capture["token_id"].values[:n], dtype=np.int64)
    return measure_sensitivity(model, ids, noisy=noisy, eps=eps, kl_positions=kl_positions, noise=noise,
                               sinks=sinks, seed=seed, threads=threads, progress=progress)
