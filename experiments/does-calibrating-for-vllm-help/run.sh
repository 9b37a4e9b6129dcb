#!/bin/bash
# The exact commands of this experiment, in order (run from the repository root).
# Each evaluate ran under nohup, the two at once, on a 2-core machine shared with other work.
set -e
E=experiments/does-calibrating-for-vllm-help; S=$E/scales; CAP=/tmp/kv/repro/pydoc-4096.zarr

# 1. calibrate for vLLM (writes the config; the table is in its provenance: calibrate-vllm-table.csv)
.venv/bin/kverr calibrate --target vllm --capture $CAP --budget-bits 8.05 --context 1280 \
  --out "$E/configs/vllm-{bits}b.json" --frontier /tmp/kv/serving/vllm-frontier.csv --workers 1 --name vllm-8.05b -v \
  || true  # it wrote the config, then failed printing its table (see the README); no frontier file

# 2. scales as vLLM loads them
.venv/bin/kverr export fp8-e4m3-tensor --format vllm --capture $CAP --out $S/absmax-tensor
.venv/bin/kverr export fp8-e4m3-head --format vllm --capture $CAP --out $S/absmax-head
.venv/bin/kverr export $E/configs/vllm-8.05b.json --format vllm --capture $CAP --out $S/vllm-8.05b
.venv/bin/python -c "from kverr.io import open_capture; import numpy as np; np.save(\"/tmp/kv/serving/pydoc-4096-ids.npy\", np.asarray(open_capture(\"$CAP\")[\"token_id\"].values, dtype=np.int64))"
M=/root/.cache/kverr/smollm2-135m-instruct-q4_1-b179c9523d0e6a0f  # the bundled model as a transformers directory
/tmp/lc/bin/python $E/llmcompressor_kv.py $M /tmp/kv/serving/pydoc-4096-ids.npy tensor $S/llmcompressor-tensor.safetensors
/tmp/lc/bin/python $E/llmcompressor_kv.py $M /tmp/kv/serving/pydoc-4096-ids.npy attn_head $S/llmcompressor-head.safetensors

# 3. skip-layer configs (make_configs.py) and predicted KL
.venv/bin/python $E/make_configs.py
.venv/bin/python $E/predicted.py $CAP $E/predicted.csv

# 4. held out
export ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
TYPING=$(.venv/bin/python -c 'import typing; print(typing.__file__)')
.venv/bin/kverr evaluate --threads 1 --greedy 0 --text $TYPING --offset 0 --prefill 1024 --decode 256 --segments 8 \
  --scheme fp8-e4m3-tensor --scales unit --scheme fp8-e4m3-tensor --scales $S/absmax-tensor \
  --scheme fp8-e4m3-tensor --scales $S/llmcompressor-tensor.safetensors --scheme fp8-e4m3-tensor --scales prefill \
  --scheme fp8-e4m3-head --scales unit --scheme fp8-e4m3-head --scales $S/absmax-head --scheme fp8-e4m3-head --scales prefill \
  --config $E/configs/vllm-8.05b.json --scales $S/vllm-8.05b \
  --out /tmp/kv/serving/fp8.csv --overwrite
.venv/bin/kverr evaluate --threads 1 --greedy 0 --text $TYPING --offset 0 --prefill 1024 --decode 256 --segments 8 \
  --scheme vllm-int8-per-token-head --config $E/configs/int8-pth-skip-edges.json --config $E/configs/int8-pth-skip-calibrated.json \
  --scheme vllm-fp8-per-token-head --config $E/configs/fp8-pth-skip-edges.json --config $E/configs/fp8-pth-skip-calibrated.json \
  --out /tmp/kv/serving/skip.csv --overwrite
# per-segment rows: /tmp/kv/serving/{fp8,skip}.segments.csv, copied to $E

# 5. tables
.venv/bin/python $E/summarize.py

# 6. segments 4-7 (2026-12-02): the two evaluate runs of step 4 with --offset 5124 --segments 4
#    (the first runs had stopped after four segments), their per-segment rows appended to
#    fp8.segments.csv and skip.segments.csv with segment = offset // 1281, then summarize.py again
