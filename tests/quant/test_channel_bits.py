"""Per-channel bit widths: the format (bit for bit against the plain formats it is made of), its
bytes, its refusals, and the greedy width allocation the calibrator fits it with."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kverr.calibration import channel_bits as cb
from kverr.catalog import TEMPLATES, fitted_templates, template
from kverr.config import CacheConfig
from kverr.exceptions import ConfigError, KernelError
from kverr.memory import ModelShape, account
from kverr.quant import (
    CHANNEL_BITS,
    MSEClip,
    PerChannel,
    PerToken,
    QuantFormat,
    channel_reconstructions,
    codes_nbytes,
    dequantize,
    fake_quantize,
    packed_nbytes,
    quantize,
)

WIDTHS = (0, 2, 3, 4, 8, 2, 0, 3, 3, 2, 4, 0, 2, 2, 3, 8)


def _fmt(tokens=None, clip=None, widths=WIDTHS):
    return QuantFormat(dtype="int", bits=8, granularity=PerChannel(tokens), clip=clip or MSEClip(grid=5, min_ratio=0.6),
                       channel_bits=widths)


def _x(T=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.05, 9.0, len(WIDTHS))
    return torch.randn(2, 3, T, len(WIDTHS), generator=g) * scale + torch.linspace(-3, 3, len(WIDTHS))


@pytest.mark.parametrize("tokens", [None, 32])
def test_each_channel_is_stored_as_the_plain_format_of_its_width(tokens):
    x, f = _x(), _fmt(tokens)
    qt = quantize(x, f)
    got = dequantize(qt)
    assert torch.equal(got, fake_quantize(x, f))
    for b, idx in f.channel_widths():
        if b:
            assert torch.equal(got[..., idx], fake_quantize(x[..., idx], f.with_bits(b)))
        elif tokens is None:
            # width 0: the block mean (all tokens of the channel), rounded to nearest fp16
            want = x[..., idx].mean(-2, keepdim=True).to(torch.float16).float().expand_as(got[..., idx])
            assert torch.allclose(got[..., idx], want, rtol=0, atol=1e-6 * float(x.abs().max()))
            assert torch.equal(qt.scale[..., idx].float(), torch.zeros_like(qt.scale[..., idx].float()))
    # the codes: each width's channels packed at that width, the widths one after another
    assert qt.codes.shape[-1] == codes_nbytes(f, len(WIDTHS)) == sum(
        packed_nbytes(len(i), b) for b, i in f.channel_widths() if b)
    assert torch.equal(quantize(got, f).unpacked_codes(), qt.unpacked_codes())  # idempotent
    # what the calibrator assembles widths from is the same reconstruction
    rec = channel_reconstructions(x, f.with_bits(2))
    pick = torch.stack([rec[CHANNEL_BITS.index(b), ..., i] for i, b in enumerate(WIDTHS)], -1)
    assert torch.equal(pick, got)


def test_json_round_trip_label_and_refusals():
    f = _fmt()
    d = f.to_dict()
    assert d["channel_bits"] == list(WIDTHS) and d["bits"] == 8
    assert QuantFormat.from_dict(json.loads(json.dumps(d))) == f
    assert f.element_bits == pytest.approx(sum(WIDTHS) / len(WIDTHS)) and "cb02348" in f.label()
    with pytest.raises(ConfigError, match="largest of channel_bits"):
        QuantFormat.from_dict({**d, "bits": 4})
    for bad, match in (
        (dict(channel_bits=(0, 1, 2)), "one of 0, 2, 3, 4, 8"),
        (dict(channel_bits=(0, 0)), "at least one channel"),
        (dict(channel_bits=(2, 3), symmetric=True), "asymmetric"),
        (dict(channel_bits=(2, 3), granularity=PerToken()), "per-channel scales"),
        (dict(channel_bits="23"), "one width per channel"),
    ):
        kw = dict(dtype="int", bits=2, granularity=PerChannel(None)) | bad
        with pytest.raises(ConfigError, match=match):
            QuantFormat(**kw)
    with pytest.raises(ConfigError, match="16 widths for a head dimension of 8"):
        quantize(torch.zeros(1, 4, 8), f)
    from kverr.gpu.spec import kernel_spec

    assert kernel_spec(f, len(WIDTHS), 64).bits == 0  # static channel scales: the kernels serve it
    with pytest.raises(KernelError, match="channel_bits.*tokens"):
        kernel_spec(_fmt(tokens=16), len(WIDTHS), 64)


@pytest.mark.parametrize("D", [16, 64])
def test_kernel_layout_words_read_and_write_the_oracles_rows(D):
    """The layout words the kernels use (derived from ``pack_codes``) unpack every stored row to its
    codes and pack every code row to the stored bytes, for widths with every width present."""
    from kverr.gpu.spec import PIECES_PER_BYTE, mixed_layout
    from kverr.quant.reference import pack_codes

    g = torch.Generator().manual_seed(D)
    widths = tuple(CHANNEL_BITS[int(i)] for i in torch.randint(0, len(CHANNEL_BITS), (D,), generator=g))
    widths = (8, 3, 0, *widths[3:])  # every width at least once
    f = _fmt(widths=widths)
    unpack, pack = mixed_layout(f, D)
    assert unpack.shape == (D,) and pack.shape == (PIECES_PER_BYTE, D)
    u = torch.stack([torch.randint(0, 1 << b, (50,), generator=g) if b else torch.zeros(50, dtype=torch.long)
                     for b in widths], dim=1).to(torch.uint8)
    rows = pack_codes(u, f).numpy().astype(np.int64)
    cb = rows.shape[1]
    assert cb == codes_nbytes(f, D)

    def piece(w, x):
        return ((x >> ((w >> 16) & 15)) & ((w >> 20) & 255)) << ((w >> 28) & 15)

    w = unpack.astype(np.int64)
    ba, bb = rows[:, w & 255], rows[:, (w >> 8) & 255]
    got = ((ba >> ((w >> 16) & 7)) & ((w >> 22) & 255)) | (((bb >> ((w >> 19) & 7)) & ((w >> 30) & 1)) << 2)
    assert np.array_equal(got, u.numpy())
    codes = u.numpy().astype(np.int64)
    packed = sum(piece(pack[t], codes[:, pack[t] & 0xFFFF]) for t in range(PIECES_PER_BYTE))
    assert np.array_equal(packed[:, :cb], rows) and not packed[:, cb:].any()


def test_memory_counts_the_packed_widths():
    f = _fmt(clip=None)
    cfg = CacheConfig(k=f, v=QuantFormat(dtype="fp16"), page_size=16, align=1)
    rep = account(cfg, ModelShape(1, 2, len(WIDTHS)), 64)
    k = rep.per_layer[0]["k"]
    # keys: the codes of the widths (each width's plane in whole bytes: 2 + 2 + 1 + 2) for 2 heads
    # x 64 tokens; a static fp16 scale and zero per channel
    assert k.payload == 2 * 64 * codes_nbytes(f, len(WIDTHS)) == 2 * 64 * 7
    assert k.static == 2 * len(WIDTHS) * 2 * 2 and k.scales == k.zeros == 0


def test_allocation_keeps_the_byte_budget_and_follows_the_weights():
    D = 16
    rng = np.random.default_rng(0)
    var = rng.lognormal(0, 1.5, D)
    curves = np.array([var * (1.0 if b == 0 else 4.0 ** -b) for b in CHANNEL_BITS])
    prev = np.inf
    for budget in range(0, 3 * D // 8 + 1):
        bits = cb.allocate(curves, budget)
        used = sum(packed_nbytes(bits.count(b), b) for b in set(bits) if b)
        err = curves[[CHANNEL_BITS.index(b) for b in bits], np.arange(D)].sum()
        assert used <= budget and err <= prev  # within the bytes; more bytes never cost error
        prev = err
    # a channel nothing reads gets no bits; the most read gets the most
    w = curves.copy()
    w[:, 3] = 0.0
    w[:, 7] *= 1e6
    bits = cb.allocate(w, 4)
    assert bits[3] == 0 and bits[7] == max(bits)
    # a floor: every channel keeps at least the narrowest width given
    floor = cb.allocate(curves[1:], 3 * D // 8, CHANNEL_BITS[1:])
    assert min(floor) >= 2 and sum(packed_nbytes(floor.count(b), b) for b in set(floor)) <= 3 * D // 8
    # equal channels share the bytes equally
    flat = np.array([np.full(D, 1.0 if b == 0 else 4.0 ** -b) for b in CHANNEL_BITS])
    assert set(cb.allocate(flat, 2 * D // 8)) == {2}


def test_key_weights_pair_average_before_rope():
    g = torch.Generator().manual_seed(1)
    q, v, o = torch.randn(5, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(5, 8, generator=g)
    a = torch.softmax(torch.randn(5, 12, generator=g), -1)
    post = cb.key_weights(q, a, v, o, pre_rope=False, skip=2)
    pre = cb.key_weights(q, a, v, o, pre_rope=True, skip=2)
    assert torch.equal(post[:2], torch.zeros_like(post[:2]))  # sinks left out
    assert torch.allclose(pre, (post + post.roll(4, -1)) / 2)
    w = (a.double() ** 2) * ((v.double()[None] - o.double()[:, None]) ** 2).sum(-1)
    assert torch.allclose(post[5, 3], (w[:, 5] * q.double()[:, 3] ** 2).sum())


@pytest.mark.parametrize("D", [64, 128])
def test_templates_take_their_mean_bits_and_the_fitted_set_nests(D):
    from kverr.calibration.candidates import NESTED_SETS, named_candidates

    for t, (floor, mean) in zip(fitted_templates(D), TEMPLATES):
        assert codes_nbytes(t, D) * 8 == mean * D == t.element_bits * D and min(t.channel_bits) == floor
    sets = [set(named_candidates(n, D)) for n in NESTED_SETS]
    assert all(a > b for a, b in zip(sets, sets[1:]))  # each set strictly contains the next
    assert sets[0] - sets[1] == set(fitted_templates(D))
    with pytest.raises(ConfigError, match="multiple of 1/8"):
        template(2.1, D)
