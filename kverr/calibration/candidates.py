"""Candidate formats per (layer, kv head, K|V), model-wide outer options, and their exact bytes.

Every candidate is a :class:`kverr.quant.QuantFormat` whose scale groups never span two kv heads
(no ``tensor`` granularity), so the bytes of a layer are exactly the sum of the bytes of its
heads and the calibration problem separates into one choice per (layer, kv head, K|V).

The default set (:func:`default_candidates`, 78 formats for keys and for values; 60 without the
static ones):

* integers at 2, 3 and 4 bits, asymmetric (a zero point, as KIVI and quanto), with scales per
  token (``token``), per 32 channels of a token (``token_group``), per channel over 32 or 64
  tokens (``channel``, KIVI-style), each with and without a Hadamard rotation, each with absmax
  scales and with a searched MSE clip (:class:`~kverr.quant.MSEClip`, 5 ratios down to 0.6) --
  3 x 4 x 2 x 2 = 48;
* the same integers with *static* per-channel scales (``channel`` over all tokens: no metadata
  per token, which is most of what a 2- or 3-bit budget otherwise pays), with and without
  rotation, with absmax scales, the MSE clip above, and a deeper one (9 ratios down to 0.2:
  a range spanning every token is set by its rarest outliers) -- 3 x 2 x 3 = 18;
* 8-bit integers with absmax scales per token and per 32 channels, with and without rotation,
  and symmetric 8-bit groups of 32 (llama.cpp's q8_0) -- 5;
* fp8 e4m3 with an fp32 scale per token, per 32 channels and per kv head (static, vLLM's
  ``attn_head`` strategy), with and without rotation -- 6;
* plain fp16 -- 1.

Static scales are set when the cache first quantizes (a sequence's prefill, in
:class:`kverr.hf.KverrCache`; tokens beyond that range saturate) or given calibrated; the
objective sets them over the whole calibration capture. :func:`candidates_for_budget` offers
them only below :data:`STATIC_BELOW_BITS`: held out on the default model they won at 2.5 and 3
bits and lost at 4 to 5 bits, where the objective still preferred them (README, "Calibrate").

Token groups of 16 channels were in the set once and never chosen at any budget from 2.3 to 8
bits on the default model; they were dropped to pay for the static formats' scoring time.

``CalibrationConfig(codebooks=True)`` (``kverr calibrate --codebooks``) adds the nine codebook
candidates of :func:`kverr.catalog.codebook_candidates` to any named set (held out they lowered
KL by 10–19 % at 2.5 to 4 bits, docs/calibration.md); they are not in the default set, from
which the committed configs were made.

Outer options (:class:`OuterOption`) are model-wide: full-precision sink tokens ``S``, the
full-precision window ``R`` of recent tokens and pre- or post-RoPE keys. The search runs the
inner knapsack once per outer option and keeps the Pareto front of the union.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from kverr.config import CacheConfig
from kverr.exceptions import ConfigError
from kverr.catalog import CALIBRATION_MSE_CLIP, STATIC_MSE_CLIP, default_candidates, fitted_templates
from kverr.quant.formats import PerTensor, WINDOW_DTYPES, QuantFormat

__all__ = [
    "CALIBRATION_MSE_CLIP", "DEFAULT_WINDOW_DTYPE", "STATIC_MSE_CLIP", "OuterOption", "candidate_set", "candidates_for_budget",
    "check_candidates", "default_candidates", "head_bytes",
]

# The candidate list and the clips it searches live in the format catalog (kverr.catalog),
# which ahead-of-time compilation reads too.


@dataclass(frozen=True)
class OuterOption:
    """Model-wide token policy tried by the search."""

    window: int = 0
    sinks: int = 0
    key_pre_rope: bool = False
    salient: int = 0  # salient prompt tokens kept per (layer, kv head, K|V): counted, and masked by the objective
    salient_sides: str = "kv"  # the sides that keep them (CacheConfig.salient_sides)
    salient_recent: int = 0  # of them, the prompt's last tokens, wherever they are (CacheConfig.salient_recent)

    def label(self) -> str:
        sides = "" if self.salient_sides == "kv" else self.salient_sides
        recent = f"r{self.salient_recent}" if self.salient_recent else ""
        tail = f"/X{self.salient}{sides}{recent}" if self.salient else ""
        return f"S{self.sinks}/R{self.window}/{'pre' if self.key_pre_rope else 'post'}{tail}"


#: Budgets (effective bits) below which :func:`candidates_for_budget` offers static scales.
STATIC_BELOW_BITS = 3.5


#: Candidate sets by name: ``all`` (with static per-channel scales), ``dynamic`` (without),
#: ``fitted`` (``all`` and the templates of per-channel widths fitted to each head,
#: :mod:`.channel_bits`), and ``auto``, which picks ``all`` or ``dynamic`` per budget
#: (:func:`candidate_set`).
CANDIDATE_SETS = ("auto", "all", "dynamic", "fitted")


def candidate_set(budget_bits: float, which: str = "auto") -> str:
    """The set ``which`` means at a budget: ``which`` itself, or for ``auto`` ``"all"`` (with
    static per-channel scales) below :data:`STATIC_BELOW_BITS` effective bits, ``"dynamic"``
    (without) from there on."""
    if which not in CANDIDATE_SETS:
        raise ConfigError(f"candidates={which!r} is not known; use one of {', '.join(CANDIDATE_SETS)}")
    if which != "auto":
        return which
    return "all" if budget_bits < STATIC_BELOW_BITS else "dynamic"


#: Budgets (effective bits) below which ``window_dtype="auto"`` keeps sinks, window and pending
#: token blocks in int8 rows (:func:`kverr.quant.formats.window_format`), fp16 from there on. An
#: int8 window halves the bytes of the tokens it holds, and the calibrator spends them on the
#: quantized tokens and a longer window; but the window's tokens are the most attended ones and
#: the objective leaves their own rounding out (it masks the window), so it over-rates int8
#: windows at high budgets: its frontiers cross only at ~6.8 bits
#: (``bench/calibrate_window_dtype.py``), while held out, on the validation texts, int8 windows
#: lowered KL by 12-31 % at 3 and 4.5 bits and raised it by ~30 % at 5 bits
#: (``bench/results/eval/README.md``). The rule switches between the measured points.
INT8_WINDOW_BELOW_BITS = 4.75
#: Window dtypes by name for calibration: ``auto`` picks one per budget (:func:`window_dtype_for_budget`).
CALIBRATION_WINDOW_DTYPES = ("auto", *WINDOW_DTYPES)
#: The dtype calibrated configs keep their sinks, window and pending token blocks in: ``auto``,
#: int8 rows with an fp16 scale each (:func:`kverr.quant.formats.window_format`, D + 2 bytes a
#: row instead of fp16's 2 D) below :data:`INT8_WINDOW_BELOW_BITS`, fp16 from there
#: on (:func:`window_dtype_for_budget`). Held out, the int8 window lowered the 3-bit
#: config's KL by ~30 % and the 4.5-bit one's by ~12 % against fp16 on two validation texts, and
#: raised the 5-bit one's by ~30 % (README).
DEFAULT_WINDOW_DTYPE = "auto"


def window_dtype_for_budget(budget_bits: float, which: str = "auto") -> str:
    """The window dtype ``which`` means at a budget (``auto``: ``int8`` below
    :data:`INT8_WINDOW_BELOW_BITS` effective bits, ``fp16`` from there on)."""
    if which not in CALIBRATION_WINDOW_DTYPES:
        raise ConfigError(f"window_dtype={which!r} is not known; use one of {', '.join(CALIBRATION_WINDOW_DTYPES)}")
    if which != "auto":
        return which
    return "int8" if budget_bits < INT8_WINDOW_BELOW_BITS else "fp16"


def candidates_for_budget(budget_bits: float, head_dim: int = 64, which: str = "auto") -> tuple[QuantFormat, ...]:
    """The default candidates of :func:`candidate_set` ``(budget_bits, which)``."""
    return named_candidates(candidate_set(budget_bits, which), head_dim)


#: The named sets, each a superset of those after it (a search of a later set can reuse the
#: damage tables of an earlier one).
NESTED_SETS = ("fitted", "all", "dynamic")


def named_candidates(name: str, head_dim: int = 64) -> tuple[QuantFormat, ...]:
    """The candidates of a named set of :data:`NESTED_SETS`."""
    if name not in NESTED_SETS:
        raise ConfigError(f"candidate set {name!r} is not known; use one of {', '.join(NESTED_SETS)}")
    out = default_candidates(head_dim, static=name in ("all", "fitted"))
    if name == "fitted":
        out += fitted_templates(head_dim)
    return out


def check_candidates(cands: Sequence[QuantFormat], head_dim: int, page_size: int, which: str) -> None:
    """Raise :class:`ConfigError` for candidates the per-head search cannot use."""
    if not cands:
        raise ConfigError(f"no {which} candidates given")
    if len(set(cands)) != len(cands):
        raise ConfigError(f"the {which} candidates contain duplicates")
    for i, f in enumerate(cands):
        if not isinstance(f, QuantFormat):
            raise ConfigError(f"{which} candidate {i} is a {type(f).__name__}, not a QuantFormat")
        if isinstance(f.granularity, PerTensor) and not f.is_float:
            raise ConfigError(
                f"{which} candidate {f.label()} has a 'tensor' granularity, whose one scale spans "
                "every head sharing the format; per-head search needs 'head' instead"
            )
        f.check_head_dim(head_dim, f"{which} candidate {f.label()}")
        CacheConfig(k=f, v=f, page_size=page_size)  # block/page fit


@lru_cache(maxsize=None)
def head_bytes(
    fmt: QuantFormat,
    option: OuterOption,
    head_dim: int,
    context: int,
    page_size: int = 64,
    window_dtype: str = "fp16",
    align: int = 16,
    sliding_window: int = 0,
    *,
    which: str,
    batch: int = 1,
    width_tables: bool = False,
) -> int:
    """Exact cache bytes of one kv head's keys or values (``which``) stored with ``fmt`` at ``context`` tokens
    for ``batch`` sequences (their static bytes counted once); with ``width_tables``, a format with
    per-channel widths also counts the width table each sequence stores when its widths are refit
    on its prompt (:func:`kverr.calibration.refit.width_row_nbytes`).

    Counted by :func:`kverr.memory.account` on a one-layer, one-head model, so payload, scales,
    zero points, page rounding, alignment, sinks and window are all included; because no
    candidate's scale group spans heads, a layer's bytes are the sum of its heads' bytes. In a
    layer with a ``sliding_window`` only the tokens of the window are held.
    """
    from kverr.memory import ModelShape, account

    cfg = CacheConfig(
        k=fmt, v=fmt, window=option.window, sinks=option.sinks, key_pre_rope=option.key_pre_rope,
        page_size=page_size, window_dtype=window_dtype, align=align, salient=option.salient,
        salient_sides=option.salient_sides, salient_recent=option.salient_recent,
    )
    shape = ModelShape(1, 1, head_dim, sliding_windows=(sliding_window,))
    nbytes = account(cfg, shape, context, batch=batch).per_layer[0][which].total
    if width_tables and fmt.channel_bits is not None:
        from .refit import width_row_nbytes

        nbytes += batch * width_row_nbytes(head_dim)
    return nbytes
