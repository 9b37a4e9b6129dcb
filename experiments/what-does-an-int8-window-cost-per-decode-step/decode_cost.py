"""CPU reference path: teacher-forced decode with the committed 3-bit config, its int8 window
against the same config with an fp16 window (P=1024, 96 decode steps, one thread; int8 timed
twice around fp16, since the machine is shared).

Usage::

    python experiments/what-does-an-int8-window-cost-per-decode-step/decode_cost.py   (from the repository root)
"""
import time, torch, sys
torch.set_num_threads(1)
from kverr.capturing import load_text
from kverr.capturing.model import load_model
from kverr.capturing.text import tokenize
from kverr.hf import cache_for
from kverr.evaluation import teacher_forced
from kverr.config import CacheConfig
m = load_model("default")
ids = tokenize(m.tokenizer, load_text("pydoc"), 1024 + 96, 0)
cfg = CacheConfig.load("data/configs/calibrated-3b.json")
for name, c in (("int8", cfg), ("fp16", cfg.with_(window_dtype="fp16")), ("int8", cfg)):
    t = time.perf_counter()
    teacher_forced(m.model, cache_for(m.model, c), torch.as_tensor(ids), 1024, flush=True)
    print(name, f"{time.perf_counter() - t:.1f} s", flush=True)
