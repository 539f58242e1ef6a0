"""MXFP4 checkpoints (gpt-oss as OpenAI ships it): the MoE experts dequantized at load time.

Format: OCP Microscaling Formats (MX) Specification v1.0 (2023), MXFP4. A block of 32 values
shares one scale X, an E8M0 power of two (a uint8 exponent, bias 127: X = 2^(byte - 127);
0xFF is NaN); each value P is FP4 E2M1 (1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1, 1.5,
2, 3, 4, 6 and their negatives, code = sign << 3 | magnitude index), and the value is X * P.

Layout, as the released gpt-oss-20b/120b checkpoints store it and transformers reads it
(``transformers/integrations/mxfp4.py``, ``_convert_moe_packed_tensors``, transformers 5.24):
``model.layers.N.mlp.experts.{gate_up_proj,down_proj}_blocks`` uint8 [E, R, G, 16] and
``..._scales`` uint8 [E, R, G], where R is the weight's output dimension, G the number of
32-value blocks along its input dimension (the input size is G * 32), and byte j of a block
holds value 2j in its low nibble and value 2j + 1 in its high nibble. Dequantized, a tensor is
[E, R, G * 32] ([out, in] per expert) and transposed to transformers' ``gate_up_proj``
[E, H, 2I] (gate and up columns interleaved) / ``down_proj`` [E, I, H] layout, which
``pdserve.engine.models.gpt_oss`` already loads. The checkpoint's ``modules_to_not_convert``
(attention, router, embedding, LM head) are stored as plain float tensors and load as usual.

Why dequantize: CPU torch has no MXFP4 matmul, so the experts are widened once, at load, to
the model dtype, and run as the float experts do. That costs memory: MXFP4 is 17 bytes per 32
values (4.25 bits); bfloat16 takes 3.8x that and float32 7.5x. gpt-oss-20b's experts (24 layers
x 32 experts x 24.9e6 values, 19.1e9) are 9.5 GiB packed and 35.6 GiB in bfloat16; gpt-oss-120b's
(36 x 128 experts, 114.7e9 values) 56.7 GiB packed and 213.6 GiB in bfloat16, split over the
ranks by TP or expert parallelism. Each rank dequantizes a whole tensor (every expert) and keeps
its share, so loading needs, beyond the rank's weights, one layer's dequantized ``gate_up_proj``
(20b: 1.0 GiB in bfloat16; 120b: 4.0 GiB). On CUDA, vLLM runs MXFP4 natively with Marlin /
Triton kernels (and transformers with OpenAI's Triton kernels); pdserve has none of those.
"""

from __future__ import annotations

import torch

QUANT_METHOD = "mxfp4"
BLOCK_SIZE = 32  # values per shared scale
SCALE_BIAS = 127  # E8M0 exponent bias
SUFFIXES = ("_blocks", "_scales")
# FP4 E2M1 value of each 4-bit code (bit 3: sign; bits 0-2: magnitude), as transformers' FP4_VALUES.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def split_name(hf_name: str) -> tuple[str, str] | None:
    """``...gate_up_proj_blocks`` -> (``...gate_up_proj``, ``"_blocks"``); None for other names."""
    for suffix in SUFFIXES:
        if hf_name.endswith(suffix):
            return hf_name[: -len(suffix)], suffix
    return None


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., G, 16] (or [..., G * 16]) and scales uint8 [..., G] -> values in
    ``dtype`` [..., G * 32], value 2j of a block from byte j's low nibble and 2j + 1 from its high
    nibble, times 2^(scale - 127). Computed in float32, where every product is exact, and cast
    once. Raises ValueError for mismatched shapes, non-uint8 tensors or a NaN scale (0xFF)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() == scales.dim():  # blocks stored with each row's G * 16 bytes flat
        blocks = blocks.reshape(*scales.shape, -1)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK_SIZE // 2}] for scales [..., G])")
    if scales.numel() and int(scales.max()) == 0xFF:
        raise ValueError("MXFP4 scale 0xFF (NaN in the MX spec) in the checkpoint")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    groups = scales.shape[-1] if scales.dim() else 1
    out = torch.empty(*scales.shape, BLOCK_SIZE, dtype=dtype)
    rows, row_scales, row_out = blocks.reshape(-1, groups, 16), scales.reshape(-1, groups), out.view(-1, groups, 32)
    chunk = max(1, (1 << 22) // (groups * 16))  # rows per step: ~4 MiB of packed bytes bounds the temporaries
    for start in range(0, rows.shape[0], chunk):
        blk = rows[start:start + chunk]  # (c, G, 16)
        values = torch.empty(*blk.shape[:-1], BLOCK_SIZE, dtype=torch.float32)
        values[..., 0::2] = lut[(blk & 0x0F).long()]
        values[..., 1::2] = lut[(blk >> 4).long()]
        exponent = row_scales[start:start + chunk].to(torch.int32) - SCALE_BIAS  # (c, G)
        values *= torch.exp2(exponent.float()).unsqueeze(-1)
        row_out[start:start + chunk] = values.to(dtype)
    return out.reshape(*blocks.shape[:-2], -1)


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An expert tensor's blocks [E, R, G, 16] and scales [E, R, G] -> transformers' layout
    [E, G * 32, R] in ``dtype`` (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]): a
    transposed view, the copy is left to the weight loader. Raises ValueError as
    ``dequantize_rows`` does, or for a tensor that is not 3-D once dequantized."""
    out = dequantize_rows(blocks, scales, dtype)  # (E, R, G * 32): [out, in] per expert
    if out.dim() != 3:
        raise ValueError(f"MXFP4 expert tensor of shape {tuple(out.shape)}: expected [experts, rows, columns]")
    return out.transpose(1, 2)
