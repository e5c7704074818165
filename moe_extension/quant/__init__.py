"""Weight and activation preparation for the quantized formats of the moe_ext ops.

- ``fp8_block``: e4m3fn weights with fp32 (or UE8M0 byte) scales per 128 x 128 block, activations per token per
  128 columns (``quant="fp8_block"``).
- ``mxfp4``: packed e2m1 weights with E8M0 scales per 32 elements (``quant="mxfp4"``).
"""

from moe_extension.quant.fp8_block import (  # noqa: F401
    FP8_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    fake_quantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
    ue8m0_scales,
)
from moe_extension.quant.mxfp4 import (  # noqa: F401
    E2M1_VALUES,
    MXFP4_BLOCK,
    dequantize_mxfp4,
    e2m1_table,
    e8m0_to_float,
    quantize_mxfp4,
    unpack_mxfp4,
)
