"""The attention-error terms: their one definition, shared by every path that computes them.

For one query q, keys K, values V and logit scale c::

    s = c·qKᵀ,  a = softmax(s),  o = aV
    K̂ = K + E_K,  V̂ = V + E_V,  δs = c·qE_Kᵀ,  a′ = softmax(s + δs)
    o′ − o = (a′ − a)V  +  aE_V  +  (a′ − a)E_V
             key term     value term   cross term

The streaming decomposition (:mod:`kverr.error.stream`, behind :func:`kverr.error.decompose`)
and the calibration objective (:mod:`kverr.calibration.objective`) both take these terms from
here; :mod:`kverr.error.naive` states them once more, per query and plainly, as the reference
the tests hold this module's users to.

The weight change δa = a′ − a. Forming a′ and a and subtracting loses a small δa to
cancellation. With the *growth* u_j = a_j·expm1(δs_j) (so that a′ ∝ a + u) and
δlse = log Σ_j a_j e^{δs_j} = log1p(Σ_j u_j), three forms are exact and free of cancellation::

    δa = a·expm1(δs − δlse)                                  (weight_change)
       = a·(expm1(δs)·e^{−δlse} + expm1(−δlse))              (weight_change_from_expm1)
       = (u − a·Σu) / (1 + Σu)                               (key_term_from_growth, after V)

They are the same quantity evaluated in different orders, and each caller keeps the one its
numbers were defined with (calibrated configs depend on them bit for bit):

* :func:`weight_change_from_expm1` needs only running sums Σp and Σp·expm1(δs) of unnormalised
  weights p, which an online softmax over key blocks provides: the streaming engine.
* :func:`key_term_from_growth` pushes u through V before normalising, so a whole float32 batch of
  candidate formats costs one matmul: the objective's fast path. It needs e^{δs} finite and
  1 + Σu well away from 0, which :func:`growth_normaliser` lets the caller check.
* :func:`weight_change` through ``logsumexp(log a + δs)`` cannot overflow (a·e^{δs} ≤ e^{δlse}):
  the objective's fallback, in float64, where the fast path is unsafe.

The first-order change through the softmax Jacobian J = diag(a) − aaᵀ is
Jδs = a·(δs − μ), μ = Σ a·δs (:func:`first_order_weight_change`), and the divergence between the
two weight rows is KL(a‖a′) = δlse − μ (:func:`kl_divergence`).

All functions take torch tensors whose last axis is the key axis (``T``) for weights and logits
and the value channel (``Dv``) for outputs; leading axes are batch axes and broadcast.
"""

from __future__ import annotations

import torch

__all__ = [
    "delta_lse",
    "first_order_weight_change",
    "growth",
    "growth_normaliser",
    "key_term",
    "key_term_from_growth",
    "kl_divergence",
    "output_terms",
    "value_error_weight",
    "value_stack",
    "value_term",
    "weight_change",
    "weight_change_factors",
    "weight_change_from_expm1",
]


# --------------------------------------------------------------------------------------------
# the weight change
# --------------------------------------------------------------------------------------------


def growth(a: torch.Tensor, delta_logits: torch.Tensor) -> torch.Tensor:
    """Weight growth ``u = a·expm1(δs)``: the reconstructed weights are ``a′ = (a + u)/(1 + Σu)``.

    Parameters
    ----------
    a : torch.Tensor
        ``[..., T]`` clean attention weights (0 where a key is hidden).
    delta_logits : torch.Tensor
        ``[..., T]`` logit change δs (broadcasts against ``a``).

    Returns
    -------
    torch.Tensor
        ``[..., T]`` u, a new tensor.
    """
    return torch.expm1(delta_logits).mul_(a)


def growth_normaliser(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σu`` and ``1 + Σu = Σ a·e^{δs} = e^{δlse}`` of a growth row ``u [..., T]``.

    Returns
    -------
    tuple of torch.Tensor
        ``[..., 1]`` each (kept dims, so they broadcast against rows and outputs).
    """
    us = u.sum(-1, keepdim=True)
    return us, 1.0 + us


def key_term_from_growth(u: torch.Tensor, u_sum: torch.Tensor, z: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor) -> torch.Tensor:
    """Key term ``(a′ − a)V = (uV − o·Σu)/(1 + Σu)``, with u pushed through V before normalising.

    Exact and free of cancellation while ``e^{δs}`` is finite and ``z = 1 + Σu`` is not so small
    that its rounding matters; the caller checks both (see :func:`growth_normaliser`) and else
    uses :func:`weight_change`.

    Parameters
    ----------
    u : torch.Tensor
        ``[..., M, T]`` growth rows (:func:`growth`).
    u_sum, z : torch.Tensor
        ``[..., M, 1]`` Σu and 1 + Σu (:func:`growth_normaliser`).
    v : torch.Tensor
        ``[T, Dv]`` (or batched ``[..., T, Dv]``) clean values.
    out : torch.Tensor
        ``[M, Dv]`` (or ``[..., M, Dv]``) clean outputs o = aV.

    Returns
    -------
    torch.Tensor
        ``[..., M, Dv]`` key term.
    """
    return (torch.matmul(u, v) - out * u_sum) / z


def weight_change(a: torch.Tensor, delta_logits: torch.Tensor, rest: torch.Tensor | None = None) -> torch.Tensor:
    """Exact weight change ``δa = a·expm1(δs − δlse)``, ``δlse = logsumexp(log a + δs)``.

    Cannot overflow: ``a·e^{δs} ≤ e^{δlse}`` for every key, whatever the size of δs. Keys with
    ``a = 0`` (hidden by causality) get δa = 0 whatever their δs. ``rest [..., 1]``: weight of
    the row outside the keys, which no error changes (a learned sink's), so that
    ``δlse = log(rest + Σ a·e^{δs})``.

    Parameters
    ----------
    a : torch.Tensor
        ``[..., T]`` clean attention weights.
    delta_logits : torch.Tensor
        ``[..., T]`` logit change δs (broadcasts against ``a``).

    Returns
    -------
    torch.Tensor
        ``[..., T]`` δa = a′ − a.
    """
    la = torch.log(a) + delta_logits
    if rest is not None:
        la = torch.cat([la, torch.log(rest).expand(*la.shape[:-1], 1)], -1)
    lz = torch.logsumexp(la, -1, keepdim=True)
    return torch.where(a > 0, a * torch.expm1(delta_logits - lz), 0.0)


def delta_lse(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``δlse = log Σ a·e^{δs} = log1p(W/Z)`` from sums over unnormalised weights p (a = p/Z).

    Parameters
    ----------
    w : torch.Tensor
        ``[...]`` W = Σ p·expm1(δs).
    z : torch.Tensor
        ``[...]`` Z = Σ p.

    Returns
    -------
    torch.Tensor
        ``[...]`` δlse, the change of the log-normaliser.
    """
    return torch.log1p(w / z)


def weight_change_factors(dlse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``e^{−δlse}`` and ``expm1(−δlse)``, ``[..., 1]``: the per-row factors of
    :func:`weight_change_from_expm1` (``expm1(x − δlse) = expm1(x)·e^{−δlse} + expm1(−δlse)``)."""
    return torch.exp(-dlse).unsqueeze(-1), torch.expm1(-dlse).unsqueeze(-1)


def weight_change_from_expm1(p: torch.Tensor, e1: torch.Tensor, c_mul: torch.Tensor,
                             c_add: torch.Tensor) -> torch.Tensor:
    """``Z·δa = p·(expm1(δs)·e^{−δlse} + expm1(−δlse))``, **in place of** ``e1``.

    One fused pass over a block of keys, given only the rows' δlse (:func:`delta_lse`): what a
    streaming softmax can provide.

    Parameters
    ----------
    p : torch.Tensor
        ``[..., T]`` unnormalised clean weights (a = p/Z).
    e1 : torch.Tensor
        ``[..., T]`` expm1(δs); overwritten with the result.
    c_mul, c_add : torch.Tensor
        ``[..., 1]`` :func:`weight_change_factors` of the rows.

    Returns
    -------
    torch.Tensor
        ``e1``, now Z·δa (the weight change in the scale of ``p``).
    """
    return e1.mul_(c_mul).add_(c_add).mul_(p)


def first_order_weight_change(p: torch.Tensor, delta_logits: torch.Tensor,
                              mu: torch.Tensor) -> torch.Tensor:
    """First-order weight change ``Jδs = a·(δs − μ)``, J = diag(a) − aaᵀ, **in place of**
    ``delta_logits``, in the scale of ``p`` (a = p/Z).

    Parameters
    ----------
    p : torch.Tensor
        ``[..., T]`` (unnormalised) clean weights.
    delta_logits : torch.Tensor
        ``[..., T]`` δs; overwritten with the result.
    mu : torch.Tensor
        ``[...]`` μ = Σ a·δs of each row.

    Returns
    -------
    torch.Tensor
        ``delta_logits``, now Z·Jδs.
    """
    return delta_logits.sub_(mu.unsqueeze(-1)).mul_(p)


def kl_divergence(dlse: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """``KL(a‖a′) = δlse − μ`` (clamped at 0 against round-off), ``[...]`` per row.

    Second order in δs, so its relative accuracy is about ulp/|δs|.
    """
    return torch.clamp(dlse - mu, min=0.0)


# --------------------------------------------------------------------------------------------
# the output terms
# --------------------------------------------------------------------------------------------


def key_term(da: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Key term ``δa·V``: ``da [..., M, T]``, ``v [..., T, Dv]`` -> ``[..., M, Dv]``."""
    return torch.matmul(da, v)


def value_term(a: torch.Tensor, e_v: torch.Tensor) -> torch.Tensor:
    """Value term ``a·E_V``: ``a [..., M, T]``, ``e_v [..., T, Dv]`` -> ``[..., M, Dv]``."""
    return torch.matmul(a, e_v)


def value_error_weight(a: torch.Tensor) -> torch.Tensor:
    """``Σ_q a_qt²`` float64 of weights ``a [M, T]``: with errors independent across tokens,
    ``E‖a·E_V‖² = Σ_t a_t² E‖e_t‖²`` summed over the ``M`` queries, so token ``t``'s value error
    costs this much per unit of squared error (``[T]``)."""
    return (a.double() ** 2).sum(0)


def value_stack(v: torch.Tensor, v_hat: torch.Tensor) -> torch.Tensor:
    """``[V, E_V, V̂]`` on the channel axis, ``[..., T, 3·Dv]``: weights times it give every output
    quantity in one matmul (see :func:`output_terms`)."""
    return torch.cat([v, v_hat - v, v_hat], dim=-1)


def output_terms(weighted: torch.Tensor, changed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The clean output and the error terms from weights pushed through :func:`value_stack`.

    Parameters
    ----------
    weighted : torch.Tensor
        ``[..., 2·Dv]`` (or more channels) a·[V, E_V].
    changed : torch.Tensor
        ``[..., 3·Dv]`` δa·[V, E_V, V̂].

    Returns
    -------
    dict of str to torch.Tensor
        ``[..., Dv]`` each: ``out`` = aV, ``value`` = aE_V, ``key`` = δaV, ``cross`` = δaE_V and
        ``total`` = a′V̂ − aV, evaluated as δaV̂ + aE_V: the same quantity without the a′V̂ ≈ aV
        cancellation, and formed from other products than the three terms (so their sum is a
        check, not a tautology).
    """
    Dv = changed.shape[-1] // 3
    value = weighted[..., Dv:2 * Dv]
    dv_hat = changed[..., 2 * Dv:]
    return dict(out=weighted[..., :Dv], value=value, key=changed[..., :Dv],
                cross=changed[..., Dv:2 * Dv], total=dv_hat + value)
