"""The skip-layer configs of this experiment, from the table ``kverr calibrate --target vllm``
recorded in ``configs/vllm-8.05b.json`` (its provenance ``dtypes_compared``).

For int8_per_token_head and fp8_per_token_head: the vLLM preset with the layers of the
``turboquant-edges`` rule (first and last two) or of the ``calibrated-as-many`` rule (as many
layers, those of most predicted damage) kept in fp16. Also writes the table as
``calibrate-vllm-table.csv``.

    .venv/bin/python experiments/does-calibrating-for-vllm-help/make_configs.py
"""

import json
from pathlib import Path

import pandas as pd

from kverr.config import Override
from kverr.engines import engine_presets
from kverr.quant import float_format

HERE = Path(__file__).parent
table = json.loads((HERE / "configs" / "vllm-8.05b.json").read_text())["provenance"]["dtypes_compared"]
df = pd.DataFrame(table)
df["skip_layers"] = df["skip_layers"].map(lambda x: " ".join(map(str, x)))
df.to_csv(HERE / "calibrate-vllm-table.csv", index=False)
fp16 = float_format("fp16")
presets = engine_presets()
for dtype, short in (("int8_per_token_head", "int8-pth"), ("fp8_per_token_head", "fp8-pth")):
    base = presets[f"vllm-{dtype.replace('_', '-')}"]
    for rule, tag in (("calibrated-as-many", "calibrated"), ("turboquant-edges", "edges")):
        skip = [r for r in table if r["dtype"] == dtype and r["skip_rule"] == rule][0]["skip_layers"]
        cfg = base.with_(name=f"{short}-skip-{tag}", layers={l: Override(k=fp16, v=fp16) for l in skip})
        cfg.save(HERE / "configs" / f"{short}-skip-{tag}.json")
        print(cfg.name, skip)
