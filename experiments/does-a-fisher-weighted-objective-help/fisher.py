"""Price attention-output errors by the model's Fisher information instead of one measured
sensitivity per layer.

The objective prices an error ``δo`` of one query head's attention output (its slice of the
``o_proj`` input) as ``w_l ‖δo‖² / (n_q · mean ‖o‖²)``: isotropic within the head, one weight per
layer, measured with isotropic noise. The second-order expansion of the next-token KL prices it
as ``½ δoᵀ F δo`` instead, ``F = E_y[g gᵀ]`` with ``g`` the gradient of ``log p(y)`` with respect
to that slice and ``y`` drawn from the model's own next-token distribution (the Fisher
information; summed over the positions a perturbation reaches, the sum of their KLs).

Subcommands:

``measure OUT.npz``
    ``F [layer, q_head, D, D]`` of the default model on ``--tokens`` tokens of ``--text`` from
    ``--offset`` (``--samples`` draws of ``y`` per position, seeded), averaged over the positions
    past the first ``--skip``.
``predict CONFIG FISHER.npz CAPTURE OUT.csv``
    Each format family's damage (``../do-format-families-cost-what-the-objective-says/``) under
    ``F``: the objective's key and value terms, each query head's term weighed by its ``F``.
``weights CONFIG FISHER.npz CAPTURE OUT.csv``
    The isotropic weight per layer ``F`` implies (``½ m_l tr F_l / n``) beside the noise-measured
    one in ``CONFIG``'s provenance: a check of ``F``.
``calibrate CAPTURE FISHER.npz OUTDIR``
    ``data/configs/windows-*b``'s settings at ``--queries`` positions, every damage so priced
    (the layer weights 1, no sensitivity measured).

The weighting is installed by patching the objective (``install``): each key or value term
``t [C, g·n, D]`` of the query heads ``qi`` of a kv head becomes ``t·L`` with ``L Lᵀ = F`` of each
head, and each layer's normaliser becomes 2 -- ``Σ_heads mean_q ½ tᵀ F t``.

Usage (from the repository root):
    PYTHONPATH=. python experiments/does-a-fisher-weighted-objective-help/fisher.py measure OUT.npz
    PYTHONPATH=. python experiments/does-a-fisher-weighted-objective-help/fisher.py predict \
        data/configs/windows-3b.json OUT.npz out/bench/pydoc-4096.zarr OUT.csv --compensated-keys
    PYTHONPATH=. python experiments/does-a-fisher-weighted-objective-help/fisher.py calibrate \
        out/bench/pydoc-4096.zarr OUT.npz OUTDIR --budgets 2.5,3 --queries 128
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench.heldout import experiment_script

families = experiment_script("do-format-families-cost-what-the-objective-says", "families.py")


def measure(a) -> None:
    from kverr.capturing import load_model
    from kverr.capturing.text import load_text, tokenize

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    loaded = load_model("default")
    model = loaded.model
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.as_tensor(tokenize(loaded.tokenizer, load_text(a.text), a.tokens, a.offset))[None]
    store: dict[int, torch.Tensor] = {}

    def pre(_m, args, i):
        args[0].retain_grad()
        store[i] = args[0]

    hooks = [model.model.embed_tokens.register_forward_hook(lambda _m, _a, out: out.requires_grad_())]
    hooks += [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args, i=i: pre(m, args, i))
              for i, layer in enumerate(model.model.layers)]
    t0 = time.perf_counter()
    logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    for h in hooks:
        h.remove()
    L, Hq, D = loaded.n_layers, loaded.n_q_heads, loaded.head_dim
    F = torch.zeros((L, Hq, D, D), dtype=torch.float64)
    for s in range(a.samples):
        y = torch.multinomial(logp.exp(), 1)
        for x in store.values():
            x.grad = None
        logp.gather(-1, y).sum().backward(retain_graph=s < a.samples - 1)
        for i, x in store.items():
            g = x.grad[0, a.skip:].double().reshape(-1, Hq, D)
            F[i] += torch.einsum("thd,the->hde", g, g)
        print(f"sample {s + 1}/{a.samples}: {time.perf_counter() - t0:.0f} s", flush=True)
    F /= a.samples * (ids.shape[1] - a.skip)
    np.savez(a.out, fisher=F.numpy(), text=a.text, tokens=a.tokens, offset=a.offset, skip=a.skip, samples=a.samples,
             seed=a.seed)
    tr = F.diagonal(dim1=-2, dim2=-1).sum(-1)
    print("trace per layer (mean over q heads):", np.array2string(tr.mean(1).numpy(), precision=3), flush=True)


_state = threading.local()


def install(path: Path) -> None:
    """Patch the objective so that every key and value term is weighed by each query head's
    Fisher information (module docstring)."""
    import kverr.calibration.objective as obj
    import kverr.calibration.search as search
    from kverr.error import terms

    F = torch.as_tensor(np.load(path)["fisher"])
    D = F.shape[-1]
    ridge = 1e-9 * F.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None].clamp(min=1e-30)
    fac = torch.linalg.cholesky(F + ridge * torch.eye(D, dtype=F.dtype))  # F = L Lᵀ

    groups = obj._head_groups

    class Groups(list):
        """The objective's ``(kv_head, q_heads)`` list, which says the layer and query heads of
        each kv head to the patched terms as it is iterated (as often as the caller does)."""

        def __init__(self, prep):
            super().__init__(groups(prep))
            self.layer = prep.layer

        def __iter__(self):
            for h, qi in list.__iter__(self):
                _state.cur = (self.layer, qi)
                yield h, qi

    def weighed(fn):
        def f(*args, **kw):
            t = fn(*args, **kw)  # [C, g·n, D]
            layer, qi = _state.cur
            g = qi.numel()
            C, gn, _ = t.shape
            w = fac[layer, qi].to(t.dtype)
            return torch.einsum("cgnd,gde->cgne", t.reshape(C, g, gn // g, D), w).reshape(C, gn, D)
        return f

    prepare = obj.prepare_layer

    def prepare_layer(*args, **kw):
        return dataclasses.replace(prepare(*args, **kw), norm=2.0)

    obj._head_groups = Groups
    obj.prepare_layer = search.prepare_layer = prepare_layer
    for name in ("key_term_from_growth", "key_term", "value_term"):
        setattr(terms, name, weighed(getattr(terms, name)))


def predict(a) -> None:
    import pandas as pd

    from kverr.config import CacheConfig
    from kverr.io import open_capture
    from kverr.memory import model_shape

    known = {*families.FAMILIES, *families.SUBFAMILIES, "all"}
    bad = {f.partition("@")[0] for fam in a.families for f in fam.split("+")} - known
    if bad:
        raise SystemExit(f"unknown families {sorted(bad)}; choose from {', '.join(sorted(known))}")
    torch.set_num_threads(a.threads)
    install(a.fisher)
    from kverr.calibration import objective

    cfg = CacheConfig.load(a.config)
    if a.compensated_keys:
        cfg = cfg.with_(key_rounding="compensated")
    shape = model_shape("default")
    capture = open_capture(a.capture)
    rows = []
    for fam in a.families:
        keep = set(families.FAMILIES) if fam == "all" else set(fam.split("+"))
        out = objective.predict(capture, families.only(cfg, shape.n_layers, shape.n_kv_heads, keep),
                                queries=a.queries)
        rows.append({"config": cfg.name, "family": fam, "fisher_kl": out["total"],
                     "k": float(out["k"].sum()), "v": float(out["v"].sum())})
        print(rows[-1], flush=True)
        pd.DataFrame(rows).to_csv(a.out, index=False)


def calibrate(a) -> None:
    install(a.fisher)
    from kverr.calibration import CalibrationConfig, Sensitivity
    from kverr.calibration import calibrate as run
    from kverr.io import open_capture

    a.outdir.mkdir(parents=True, exist_ok=True)
    budgets = tuple(float(b) for b in a.budgets.split(","))
    settings = CalibrationConfig(budgets=budgets, context=1280, batch=8, refit_widths=True, compensated_keys=True,
                                 candidates="fitted", codebooks=True, salient=8, queries=a.queries, sinks=(4,),
                                 windows=(16, 32, 64, 128), window_per_head=True)
    cap = open_capture(a.capture)
    t0 = time.perf_counter()
    cal = run(cap, settings, workers=2, progress=True, sensitivity=Sensitivity.uniform([1.0] * cap.sizes["layer"]))
    print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
    summary = []
    for b in budgets:
        c = cal.config_at(b).with_(name=f"fisher-{b:g}b-q{a.queries}")
        c.save(a.outdir / f"{c.name}.json")
        pv = c.provenance
        summary.append(dict(config=c.name, bits=pv["effective_bits"], predicted=pv["predicted_damage"]))
        print(summary[-1], flush=True)
    (a.outdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def weights(a) -> None:
    """The isotropic layer weight ``F`` implies beside the config's measured one: noise
    ``δ = ε·sqrt(m_l / n)·z`` in the whole ``o_proj`` input (``n`` channels, ``m_l`` its mean
    squared norm) costs ``½ ε² (m_l / n) tr F_l`` in expectation, so ``w_l = ½ m_l tr F_l / n``."""
    import pandas as pd

    from kverr.calibration.objective import _layer_arrays, prepare_layer
    from kverr.config import CacheConfig
    from kverr.io import open_capture

    F = np.load(a.fisher)["fisher"]
    measured = CacheConfig.load(a.config).provenance["sensitivity"]["weights_k"]
    capture = open_capture(a.capture)
    n = F.shape[1] * F.shape[-1]  # channels of the whole o_proj input
    rows = []
    for layer in range(F.shape[0]):
        q, k, v, _, scale, kv_map = _layer_arrays(capture, layer, False)
        m = prepare_layer(q, k, v, None, layer=layer, kv_map=kv_map, scale=scale, queries=a.queries).norm
        tr = float(np.trace(F[layer], axis1=-2, axis2=-1).sum())
        rows.append({"layer": layer, "fisher_weight": 0.5 * m * tr / n, "measured_weight": measured[layer]})
        print(rows[-1], flush=True)
    pd.DataFrame(rows).to_csv(a.out, index=False)


def _priced(sub, name: str, queries: int) -> argparse.ArgumentParser:
    """A subcommand that prices a config on a capture under ``F``: ``CONFIG FISHER CAPTURE OUT``."""
    p = sub.add_parser(name)
    p.add_argument("config")
    p.add_argument("fisher", type=Path)
    p.add_argument("capture")
    p.add_argument("out", type=Path)
    p.add_argument("--queries", type=int, default=queries)
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("out", type=Path)
    m.add_argument("--text", default="pydoc")
    m.add_argument("--tokens", type=int, default=1024)
    m.add_argument("--offset", type=int, default=0)
    m.add_argument("--skip", type=int, default=16, help="first positions left out (the sinks, kept unquantized)")
    m.add_argument("--samples", type=int, default=8)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--threads", type=int, default=2)
    p = _priced(sub, "predict", queries=64)
    p.add_argument("--families", nargs="+", default=["all", *families.FAMILIES],
                   help="as families.py takes them (FAM+FAM, FAM@LO-HI), or all")
    p.add_argument("--compensated-keys", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("calibrate")
    c.add_argument("capture")
    c.add_argument("fisher", type=Path)
    c.add_argument("outdir", type=Path)
    c.add_argument("--budgets", default="2.5,3")
    c.add_argument("--queries", type=int, default=128)
    _priced(sub, "weights", queries=128)
    a = ap.parse_args()
    {"measure": measure, "predict": predict, "calibrate": calibrate, "weights": weights}[a.cmd](a)


if __name__ == "__main__":
    main()
