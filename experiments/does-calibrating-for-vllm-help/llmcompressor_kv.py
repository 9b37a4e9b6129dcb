"""llm-compressor's own fp8 KV-cache calibration on the bundled model, scales as vLLM loads them.

Run with a venv holding llmcompressor (it pins its own transformers, so not kverr's .venv):

    /tmp/lc/bin/python llmcompressor_kv.py MODEL_DIR IDS.npy STRATEGY OUT.safetensors [TOKENS]

MODEL_DIR: the bundled model as a transformers directory (kverr's converted copy); IDS.npy: the
calibration token ids (the capture's ``token_id``); STRATEGY: ``tensor`` or ``attn_head``.
One calibration sample of the first TOKENS ids (default 4096). Writes the
``model.layers.{i}.self_attn.{k,v}_scale`` tensors llm-compressor computed, float32, to OUT.
"""

import sys
import time

import numpy as np
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, ids_path, strategy, out = sys.argv[1:5]
tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
torch.set_num_threads(1)
ids = np.load(ids_path)[:tokens].astype(np.int64)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(model_dir)
ds = Dataset.from_dict({"input_ids": [ids.tolist()], "attention_mask": [[1] * len(ids)]})
recipe = QuantizationModifier(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": strategy,
                                               "dynamic": False, "symmetric": True})
t0 = time.time()
oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe, num_calibration_samples=1,
        max_seq_length=len(ids), pipeline="basic")
print(f"oneshot took {time.time() - t0:.1f} s")
scales = {}
for name, t in [*model.named_parameters(), *model.named_buffers()]:
    if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
        scales[name] = t.detach().to(torch.float32).reshape(-1).clone().contiguous()
print(f"{len(scales)} scales, e.g.", {k: v.tolist() for k, v in list(scales.items())[:2]})
save_file(scales, out, metadata={"format": "pt", "source": f"llmcompressor kv_cache_scheme fp8 {strategy}"})
