"""Layers and weight formats: the building blocks a model family is written in.

- ``base``: tensor-parallel linears, RMSNorm, SiLU-and-mul; ``rotary``: RoPE and its scalings.
- ``attention``: the attention interface over the paged cache; ``paged_backend`` and
  ``prefill_attention``: its native-kernel paths.
- ``decode_linear``, ``panel_linear``, ``onednn_linear``, ``weight_format``: weight layouts for few-row
  and many-row matmuls; ``elementwise``: fused RMSNorm/SwiGLU/RoPE; ``kernel_choice``: native kernel or
  torch, chosen at load by a timed probe.
- ``quantization``, ``int8_linear``, ``mxfp4``, ``compressed_tensors``: quantized weight formats.

The C++ sources, their build and the op handles live in ``pdserve.kernels``.
"""
