"""The quantization oracle: formats, granularities, reference quantize/dequantize, bit packing.

Everything here needs only numpy and torch.
"""

from kverr.quant.formats import (
    AbsMax,
    Clip,
    Granularity,
    MSEClip,
    Percentile,
    PerChannel,
    PerHead,
    PerPage,
    PerTensor,
    PerToken,
    PerTokenGroup,
    QuantFormat,
    float_format,
    fp8_format,
    int_format,
    is_static,
    token_block,
)
from kverr.quant.packing import pack, packed_nbytes, unpack
from kverr.quant.reference import (
    QTensor,
    block_shape,
    codes_nbytes,
    dequantize,
    fake_quantize,
    hadamard,
    hadamard_rotate,
    hadamard_scale,
    quantize,
    scale_shape,
)

__all__ = [
    "AbsMax", "Clip", "Granularity", "MSEClip", "Percentile", "PerChannel", "PerHead", "PerPage",
    "PerTensor", "PerToken", "PerTokenGroup", "QuantFormat", "QTensor", "block_shape",
    "codes_nbytes", "dequantize", "fake_quantize", "float_format", "fp8_format", "hadamard", "hadamard_rotate", "hadamard_scale",
    "int_format", "is_static", "pack", "packed_nbytes", "quantize", "scale_shape", "token_block",
    "unpack",
]

from kverr.quant.store import ReferenceStore, align_up, quantize_region, reconstruct, token_regions  # noqa: E402

__all__ += ["ReferenceStore", "align_up", "quantize_region", "reconstruct", "token_regions"]
