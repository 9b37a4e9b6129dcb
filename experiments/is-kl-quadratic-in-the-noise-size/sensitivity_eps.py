"""Layer sensitivity of the default model (o_proj noise, the default) at larger noise sizes: is KL
still quadratic in eps? (Per-side noise in the cached keys and values: experiments/do-key-errors-cost-more-than-predicted/.)

Usage: python experiments/is-kl-quadratic-in-the-noise-size/sensitivity_eps.py CAPTURE  (the 4096-token pydoc capture)
"""
import sys

import numpy as np
from kverr.io import open_capture
from kverr.calibration.sensitivity import sensitivity_for_capture
np.set_printoptions(precision=4, linewidth=160)
cap = open_capture(sys.argv[1])
for eps in ((0.1, 0.2), (0.2, 0.4)):
    s = sensitivity_for_capture(cap, eps=eps)
    print("eps", eps, "w(eps1) mean %.4f" % s.weights_k.mean(), "ratio KL(e2)/KL(e1)*(e1/e2)^2: min %.3f median %.3f max %.3f" % (np.nanmin(s.quadratic_ratio), np.nanmedian(s.quadratic_ratio), np.nanmax(s.quadratic_ratio)), "seconds %.1f" % s.seconds)
    print("  w:", s.weights_k)
    print("  ratio:", s.quadratic_ratio[0])
