"""Layer sensitivity of the default model per side (noise in the cached keys, or values): is KL
linear in the relative attention-output error it causes, over a range of noise sizes?

Usage: python bench/calibrate_sensitivity_eps.py  (needs /tmp/kv/pydoc-4096.zarr, see data/README.md)
"""
import numpy as np

from kverr.calibrate.sensitivity import sensitivity_for_capture
from kverr.io import open_capture

np.set_printoptions(precision=4, linewidth=160)
cap = open_capture("/tmp/kv/pydoc-4096.zarr")
for eps in ((0.05, 0.1), (0.1, 0.2), (0.2, 0.4)):
    s = sensitivity_for_capture(cap, eps=eps, sinks=4)
    q = s.quadratic_ratio
    print(f"eps {eps} (sinks 4), {s.seconds:.1f} s")
    for i, side in enumerate(("keys", "values")):
        w = (s.weights_k, s.weights_v)[i]
        print(f"  {side}: w mean {w.mean():.4f}; (KL/r)(eps2)/(KL/r)(eps1) min {np.nanmin(q[i]):.3f} "
              f"median {np.nanmedian(q[i]):.3f} max {np.nanmax(q[i]):.3f}")
        print("    w:", w)
        print("    r(eps1):", s.rel[i, :, 0])
    print("  w_K / w_V per layer:", s.weights_k / s.weights_v)
