"""Measured layer sensitivity: next-token KL per unit of relative squared attention-output error.

The calibration objective (:mod:`.objective`) predicts, per layer, a *relative* squared error of
the attention output before ``o_proj``, ``r_l = mean ‖δo‖² / mean ‖o‖²``. Layers do not matter
equally to the model's output: the same ``r_l`` in one layer can cost far more next-token KL than
in another. :func:`measure_sensitivity` measures that with the real model on the calibration
text:

The protocol mirrors the evaluation (a clean prefill, then decode steps that read a quantized
cache): of ``T`` tokens of calibration text, the first ``P = T - N`` are a clean prefix and the
last ``N`` ("noisy") positions get the error.

1. a clean forward over the ``T`` tokens records the residual stream entering every layer at the
   noisy positions, the mean squared norm ``m_l = mean_t ‖o_t‖²`` of each layer's attention
   output (the ``o_proj`` input) there, and the clean next-token log-probabilities;
2. for each layer ``l``, a fixed Gaussian noise ``z`` (seeded per layer) scaled to
   ``δ = ε·sqrt(m_l / n)·z`` (``n`` = the width of the ``o_proj`` input, so ``E‖δ_t‖² = ε² m_l``,
   i.e. a relative squared error ``ε²`` in the objective's units) is added to the ``o_proj`` input
   at the noisy positions, and layers ``l..`` are run again on those positions only, over a cache
   of the clean prefix (positions before ``P`` cannot see the noise), for two sizes ``ε₁ < ε₂``
   in one batch (the same ``z``);
3. ``KL_l(ε) = mean_t KL(p_clean,t ‖ p_noisy,t)`` over up to ``kl_positions`` evenly spaced
   noisy positions, and the sensitivity ``w_l = KL_l(ε₁) / ε₁²`` in nats per unit of relative
   squared error.

In the quadratic regime ``KL_l(ε₂) / KL_l(ε₁) = (ε₂/ε₁)²``; :attr:`Sensitivity.quadratic_ratio`
reports ``(KL_l(ε₂)/ε₂²) / (KL_l(ε₁)/ε₁²)`` per layer (1 in that regime). The noise is isotropic,
which a quantization error is not; ``w_l`` is the layer's mean sensitivity to an error of that
size, not a per-direction one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kverr.errors import CaptureError, ConfigError

log = logging.getLogger(__name__)

#: Default noise sizes (relative RMS of the attention output): per-layer relative squared errors
#: of calibrated configs lie around 1e-3 .. 5e-2, i.e. ε ~ 0.03 .. 0.2.
DEFAULT_EPS = (0.05, 0.1)
#: Clean prefix + noisy positions (512 + 128 tokens by default).
DEFAULT_TOKENS = 640
DEFAULT_NOISY = 128
DEFAULT_KL_POSITIONS = 128


@dataclass
class Sensitivity:
    """Per-layer sensitivity of next-token KL to relative attention-output error.

    Attributes
    ----------
    weights : ndarray ``[layer]``
        ``w_l = KL_l(ε₁) / ε₁²`` (nats per unit relative squared error).
    kl : ndarray ``[layer, eps]``
        Measured mean KL at each noise size.
    eps : tuple of float
        Noise sizes ``ε₁ < ε₂``.
    tokens : int
        Tokens of calibration text the model ran on (the first ``tokens`` of the capture).
    noisy : int
        The last ``noisy`` of them got the noise (the rest is a clean prefix).
    kl_positions : int
        Positions at which KL was measured.
    """

    weights: np.ndarray
    kl: np.ndarray
    eps: tuple[float, ...]
    tokens: int
    noisy: int
    kl_positions: int
    seed: int = 0
    seconds: float = 0.0
    model_id: str = ""
    weights_sha256: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def quadratic_ratio(self) -> np.ndarray:
        """``(KL(ε₂)/ε₂²) / (KL(ε₁)/ε₁²)`` per layer: 1 in the quadratic regime."""
        e = np.asarray(self.eps, dtype=np.float64)
        w = self.kl / e[None, :] ** 2
        return w[:, -1] / np.where(w[:, 0] > 0, w[:, 0], np.nan)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record for a config's provenance."""
        return {
            "method": "gaussian noise of relative RMS eps added to one layer's o_proj input at the "
                      "last `noisy` of `tokens` positions (clean prefix before); w = mean next-token "
                      "KL / eps1^2 (nats per unit relative squared attention-output error)",
            "tokens": int(self.tokens),
            "noisy": int(self.noisy),
            "kl_positions": int(self.kl_positions),
            "eps": [float(e) for e in self.eps],
            "seed": int(self.seed),
            "weights": [float(x) for x in self.weights],
            "kl": [[float(x) for x in row] for row in self.kl],
            "quadratic_ratio": [float(x) for x in self.quadratic_ratio],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sensitivity:
        return cls(weights=np.asarray(d["weights"], dtype=np.float64), kl=np.asarray(d["kl"], dtype=np.float64),
                   eps=tuple(d["eps"]), tokens=int(d["tokens"]), noisy=int(d["noisy"]), kl_positions=int(d["kl_positions"]),
                   seed=int(d.get("seed", 0)), seconds=float(d.get("seconds", 0.0)))


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
    that holds the clean prefix ``[0, P)`` (a perturbed run repeats no clean work)."""

    def __init__(self, model: Any, ids: torch.Tensor, prefix: int):
        from transformers.masking_utils import create_causal_mask

        self.base, self.layers, self.norm, self.head = _parts(model)
        self.config = self.base.config
        self.ids, self.P, self.T = ids, int(prefix), int(ids.shape[-1])
        self._mask_fn = create_causal_mask
        self.pos_all = torch.arange(self.T)[None]
        self.pos_suf = self.pos_all[:, self.P:]
        self.emb = self.base.embed_tokens(ids[None])
        self.pe_all = self.base.rotary_emb(self.emb, position_ids=self.pos_all)
        self.pe_suf = tuple(x[:, self.P:] for x in self.pe_all)
        self.cache = None

    def clean(self, record: list) -> torch.Tensor:
        """Clean forward over all tokens; ``record`` gets each layer's input at ``[P, T)``."""
        mask = self._mask_fn(config=self.config, inputs_embeds=self.emb, attention_mask=None, cache=None,
                             position_ids=self.pos_all)
        h = self.emb
        for layer in self.layers:
            record.append(h[:, self.P:])
            h = layer(h, attention_mask=mask, position_embeddings=self.pe_all, position_ids=self.pos_all)
        return h[:, self.P:]

    def fill_prefix(self, batch: int) -> None:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        h = self.emb[:, :self.P]
        pos = self.pos_all[:, :self.P]
        pe = tuple(x[:, :self.P] for x in self.pe_all)
        mask = self._mask_fn(config=self.config, inputs_embeds=h, attention_mask=None, cache=cache,
                             position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos, cache=cache,
                      use_cache=True)
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        self.cache = cache

    def run(self, h: torch.Tensor, start: int) -> torch.Tensor:
        """Layers ``start..`` on suffix inputs ``h [B, T-P, hidden]``; the cache is restored."""
        B = h.shape[0]
        pe = tuple(x.expand(B, *x.shape[1:]) for x in self.pe_suf)
        mask = self._mask_fn(config=self.config, inputs_embeds=h, attention_mask=None, cache=self.cache,
                             position_ids=self.pos_suf)
        try:
            for i in range(start, len(self.layers)):
                h = self.layers[i](h, attention_mask=mask, position_embeddings=pe, position_ids=self.pos_suf,
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
    seed: int = 0,
    threads: int = 1,
    progress: bool = False,
) -> Sensitivity:
    """Measure ``w_l`` for every layer by noise injection (see the module docstring).

    Parameters
    ----------
    model : transformers causal LM (or :class:`kverr.capture.LoadedModel`)
        The model the calibration capture came from.
    token_ids : array ``[token]``
        Calibration text (the capture's ``token_id``), ``T`` tokens.
    noisy : int
        The last ``noisy`` positions get noise (``P = T - noisy`` clean prefix tokens).
    eps : two floats
        Relative noise sizes ``ε₁ < ε₂``; ``w`` uses ``ε₁``, the pair checks the quadratic regime.
    kl_positions : int
        At most this many evenly spaced noisy positions at which KL is measured.
    threads : int
        torch threads used (restored afterwards).
    """
    from tqdm.auto import tqdm

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
    t0 = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        with torch.no_grad():
            r = _Runner(model, ids, T - noisy)
            L = len(r.layers)
            sel = torch.as_tensor(np.unique(np.linspace(0, noisy - 1, min(kl_positions, noisy))
                                            .round().astype(np.int64)))
            # clean pass: each layer's input and mean ||o_proj input||^2 at the noisy positions
            msq = [0.0] * L
            hooks = []
            for i, layer in enumerate(r.layers):
                def pre(_m, args, i=i):
                    msq[i] = float((args[0][:, r.P:].double() ** 2).sum(-1).mean())
                hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(pre))
            hs: list[torch.Tensor] = []
            try:
                h = r.clean(hs)
            finally:
                for hk in hooks:
                    hk.remove()
            ref = r.logp(h, sel)[0]  # [n, V]
            p_ref = ref.exp()
            r.fill_prefix(len(eps))
            e = torch.tensor(eps, dtype=torch.float32)
            kl = np.zeros((L, len(eps)))
            for i in tqdm(range(L), desc="calibrate: layer sensitivity", unit="layer", disable=not progress):
                o_proj = r.layers[i].self_attn.o_proj
                n = o_proj.in_features
                g = torch.Generator().manual_seed(int(seed) * 1_000_003 + i)
                z = torch.randn((noisy, n), generator=g).mul_(math.sqrt(msq[i] / n))

                def add_noise(_m, args, z=z):
                    return (args[0] + e[:, None, None] * z[None], *args[1:])

                hk = o_proj.register_forward_pre_hook(add_noise)
                try:
                    hb = r.run(hs[i].expand(len(eps), -1, -1), i)
                finally:
                    hk.remove()
                lp = r.logp(hb, sel)  # [2, n, V]
                kl[i] = (p_ref[None] * (ref[None] - lp)).sum(-1).clamp(min=0).mean(-1).numpy()
    finally:
        torch.set_num_threads(old_threads)
    w = kl[:, 0] / eps[0] ** 2
    sens = Sensitivity(weights=w, kl=kl, eps=eps, tokens=T, noisy=int(noisy), kl_positions=int(sel.numel()),
                       seed=int(seed), seconds=time.perf_counter() - t0,
                       model_id=getattr(loaded, "model_id", ""), weights_sha256=getattr(loaded, "weights_sha256", ""))
    log.info("layer sensitivity on %d tokens in %.1f s: w from %.3g to %.3g nats", T, sens.seconds, w.min(), w.max())
    return sens


def model_spec_of_capture(capture: Any) -> str:
    """The :func:`kverr.capture.load_model` spec that loads the model a capture came from."""
    from pathlib import Path

    from kverr.capture.model import DEFAULT_MODEL_ID

    mid = str(capture.attrs.get("model_id", ""))
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
    :func:`kverr.capture.load_model` spec, or a LoadedModel), after checking by weights sha256
    that it IS the model the capture was made with; :class:`CaptureError` otherwise."""
    if "token_id" not in capture:
        raise CaptureError("the capture has no token_id: recapture it to measure layer sensitivity")
    want = str(capture.attrs.get("weights_sha256", ""))
    if not want:
        raise CaptureError("the capture does not record its model's weights sha256; recapture it "
                           "or calibrate with --objective rel")
    if model is None or isinstance(model, str):
        from kverr.capture import load_model

        model = load_model(model or model_spec_of_capture(capture))
    got = str(getattr(model, "weights_sha256", ""))
    if got != want:
        raise CaptureError(
            f"the capture was made with {capture.attrs.get('model_id')!r} (weights sha256 "
            f"{want[:12]}...), not with the model given ({getattr(model, 'model_id', '?')!r}, "
            f"{got[:12]}...); calibrate with the capture's own model"
        )
    n_layers = int(capture.attrs.get("model_n_layers", capture.sizes["layer"]))
    if getattr(model, "n_layers", n_layers) != n_layers:
        raise CaptureError(f"the capture's model has {n_layers} layers, the model given {model.n_layers}")
    return model


def sensitivity_for_capture(capture: Any, *, model: Any = None, tokens: int = DEFAULT_TOKENS,
                            noisy: int = DEFAULT_NOISY, eps: Sequence[float] = DEFAULT_EPS,
                            kl_positions: int = DEFAULT_KL_POSITIONS, seed: int = 0, threads: int = 1,
                            progress: bool = False) -> Sensitivity:
    """Measure the sensitivity of the capture's model (see :func:`check_capture_model` for
    ``model``) on the capture's first ``tokens`` token ids."""
    model = check_capture_model(capture, model)
    n = min(int(tokens), int(capture.sizes["token"]))
    if n <= noisy:
        raise CaptureError(f"the capture has {n} tokens; layer sensitivity needs more than noisy={noisy}")
    ids = np.asarray(capture["token_id"].values[:n], dtype=np.int64)
    return measure_sensitivity(model, ids, noisy=noisy, eps=eps, kl_positions=kl_positions, seed=seed,
                               threads=threads, progress=progress)
