"""Layer sensitivity of the default model with noise in the cached keys and values (per side)
beside the default measurement (noise at the o_proj input), on the calibration capture.

Usage::

    python experiments/do-key-errors-cost-more-than-predicted/sensitivity_kv.py CAPTURE OUT_PREFIX   (the 4096-token pydoc capture, data/README.md)

Writes ``OUT_PREFIX.txt`` (the table printed) and ``OUT_PREFIX.json`` (both :class:`kverr.calibration.Sensitivity` records) and prints, per
layer, the o_proj weight, the key and value weights and their ratio, and the quadratic checks.
The kv measurement spares the first 4 tokens (the sinks of the default outer options).
"""
import datetime as dt
import json
import os
import platform
import sys

import numpy as np

from kverr.calibration.sensitivity import sensitivity_for_capture
from kverr.io import open_capture


def main() -> None:
    cap_path, prefix = sys.argv[1:3]
    cap = open_capture(cap_path)
    o = sensitivity_for_capture(cap, noise="o_proj")
    kv = sensitivity_for_capture(cap, noise="kv", sinks=4)
    lines = [f"# layer sensitivity, default model, {cap_path} (first 640 tokens: 512 prompt + 128 noisy)",
             f"# date: {dt.date.today()}  machine: {platform.node()} ({os.cpu_count()} cpus, shared)",
             f"# command: python experiments/do-key-errors-cost-more-than-predicted/sensitivity_kv.py {cap_path} {prefix}",
             f"# o_proj noise {o.seconds:.1f} s, kv noise {kv.seconds:.1f} s (one thread each)",
             "# w in nats per unit relative squared o_proj-input error; q = (KL/r)(eps2)/(KL/r)(eps1)",
             "layer  w_o_proj  w_keys  w_values  keys/values  r_keys(eps1)  r_values(eps1)  q_keys  q_values"]
    q = kv.quadratic_ratio
    for i in range(len(o.weights_k)):
        lines.append(f"{i:5d}  {o.weights_k[i]:8.4f}  {kv.weights_k[i]:6.4f}  {kv.weights_v[i]:8.4f}  "
                     f"{kv.weights_k[i] / kv.weights_v[i]:11.2f}  {kv.rel[0, i, 0]:12.3e}  {kv.rel[1, i, 0]:14.3e}  "
                     f"{q[0, i]:6.3f}  {q[1, i]:8.3f}")
    r = kv.weights_k / kv.weights_v
    lines.append(f"# keys/values: median {np.median(r):.2f}, ratio of sums {kv.weights_k.sum() / kv.weights_v.sum():.2f}, "
                 f"> 1 in {int((r > 1).sum())} of {len(r)} layers; o_proj quadratic check "
                 f"{np.nanmin(o.quadratic_ratio):.3f} .. {np.nanmax(o.quadratic_ratio):.3f}, kv "
                 f"{np.nanmin(q):.3f} .. {np.nanmax(q):.3f}")
    print("\n".join(lines))
    with open(f"{prefix}.txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(f"{prefix}.json", "w") as f:
        json.dump({"o_proj": o.to_dict(), "kv": kv.to_dict()}, f, indent=1)


if __name__ == "__main__":
    main()
