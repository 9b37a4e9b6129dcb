"""The quantization oracle: formats, granularities, reference quantize/dequantize, bit packing.

Everything here needs only numpy and torch.
"""

from kverr.quant.formats import (
    CHANNEL_BITS,
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
    codebook_format,
    float_format,
    fp4_format,
    fp8_format,
    int_format,
    is_static,
    token_block,
)
from kverr.quant.packing import pack, packed_nbytes, unpack
from kverr.quant.reference import (
    Blocks,
    QTensor,
    block_shape,
    channel_reconstructions,
    clip_range,
    codes_nbytes,
    decode_blocks,
    dequantize,
    encode_blocks,
    fake_quantize,
    fake_quantize_blocks,
    fit_params,
    hadamard,
    hadamard_rotate,
    hadamard_scale,
    mse_search,
    quantize,
    encoding_params,
    range_params,
    scale_shape,
    to_blocks,
)

__all__ = [
    "AbsMax", "Clip", "Granularity", "MSEClip", "Percentile", "PerChannel", "PerHead", "PerPage",
    "PerTensor", "PerToken", "PerTokenGroup", "QuantFormat", "QTensor", "block_shape",
    "codebook_format", "codes_nbytes", "dequantize", "fake_quantize", "float_format", "fp4_format", "fp8_format", "hadamard", "hadamard_rotate", "hadamard_scale",
    "int_format", "is_static", "pack", "packed_nbytes", "quantize", "scale_shape", "token_block",
    "unpack", "channel_reconstructions", "CHANNEL_BITS",
]
# the oracle's stages, for callers that share statistics across many formats
__all__ += ["Blocks", "clip_range", "decode_blocks", "encode_blocks", "fake_quantize_blocks", "fit_params",
            "encoding_params", "mse_search", "range_params", "to_blocks"]

from kverr.quant.store import ReferenceStore, align_up, quantize_region, reconstruct, token_regions  # noqa: E402

__all__ += ["ReferenceStore", "align_up", "quantize_region", "reconstruct", "token_regions"]
