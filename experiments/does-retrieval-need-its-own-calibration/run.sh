#!/usr/bin/env bash
# Does a calibration that models the prompt quantized whole (--decode 256) keep retrieval?
# Run from the repository root: bash experiments/does-retrieval-need-its-own-calibration/run.sh
set -euo pipefail
here=experiments/does-retrieval-need-its-own-calibration
typing_py=$(.venv/bin/python -c "import typing; print(typing.__file__)")
# 0. the 4096-token pydoc calibration capture of data/README.md (made once, in the reproducible float environment)
.venv/bin/python -c "from bench.common import pydoc_capture; pydoc_capture(4096)"
# 1. calibrate as data/configs/calibrated-{2.5,3}b.json were, with --decode 256 (about 15 min on 2 busy cores)
ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE .venv/bin/kverr calibrate --capture out/bench/pydoc-4096.zarr \
    --budget-bits 2.5,3 --context 1280 --decode 256 --out "$here/calibrated-decode-{bits}b.json" \
    --name 'calibrated-decode-{bits}b' --workers 1
# 2. the pass key at 1024 tokens, the trials of bench.retrieval (same seeds, so paired)
.venv/bin/kverr evaluate --task passkey --threads 1 --text "$typing_py" --context 1024 --depth 0,25,50,75,100 \
    --trials 4 --config "$here/calibrated-decode-2.5b.json" --config "$here/calibrated-decode-3b.json" \
    --out "$here/passkey.csv" --overwrite
# 3. running-text KL held out, the protocol of bench.heldout
.venv/bin/kverr evaluate --threads 1 --greedy 0 --text "$typing_py" --offset 0 --prefill 1024 --decode 256 \
    --segments 8 --config "$here/calibrated-decode-2.5b.json" --config "$here/calibrated-decode-3b.json" \
    --out "$here/heldout.csv" --overwrite
# 4. the multi-key variant (three named keys, one asked) on the same haystack, beside presets
.venv/bin/kverr evaluate --task passkey --keys 3 --threads 2 --text "$typing_py" --context 1024 \
    --depth 0,25,50,75,100 --trials 4 --config data/configs/calibrated-2.5b.json \
    --config data/configs/calibrated-3b.json --config "$here/calibrated-decode-2.5b.json" \
    --config "$here/calibrated-decode-3b.json" --scheme q4_0 --scheme kivi-4 --scheme kivi-2 \
    --out "$here/multikey.csv" --overwrite
