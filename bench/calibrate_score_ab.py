"""A/B of one layer's scoring: the per-format reconstruct path (objective.py of commit 7c7ba22,
saved to /tmp/kv/old_objective.py with `git show 7c7ba22:kverr/calibration/objective.py`) against
the shared reconstruction; checks the damage tables are identical and prints CPU seconds."""
import sys, time, importlib.util, torch, numpy as np
torch.set_num_threads(1)
sys.path.insert(0, "/tmp/kv")
spec = importlib.util.spec_from_file_location("kverr.calibration.old_objective", "/tmp/kv/old_objective.py")
old = importlib.util.module_from_spec(spec); sys.modules[spec.name] = old; spec.loader.exec_module(old)
from kverr.calibration import objective as new
from kverr.io import open_capture
from kverr.calibration.search import DEFAULT_OPTIONS
from kverr.calibration.candidates import default_candidates
cap = open_capture('/tmp/kv/pydoc-4096.zarr'); c = default_candidates(64)
pos, rope = new.capture_positions_rope(cap)
res = {"old": [], "new": []}
for layer in (5, 17, 29):
    q, k, v, kp, scale, kv_map = new._layer_arrays(cap, layer, False)
    prep = new.prepare_layer(q, k, v, kp, layer=layer, kv_map=kv_map, scale=scale, queries=32, positions=pos, rope=rope)
    out = {}
    for name, mod in (("old", old), ("new", new), ("old", old), ("new", new)):
        t = time.process_time(); out[name] = mod.score_layer(prep, c, c, DEFAULT_OPTIONS); res[name].append(time.process_time() - t)
    assert all(np.array_equal(a, b) for a, b in zip(out["old"], out["new"])), layer
    print(layer, "identical tables", {k: [round(x, 2) for x in v[-2:]] for k, v in res.items()}, flush=True)
print("mean CPU s per layer: old %.2f new %.2f" % (np.mean(res["old"]), np.mean(res["new"])))
