"""Dense causal attention of a prompt's rows over their own keys (fresh prefills, and prefill chunks
over their sequence's gathered cache): the part of the ``paged`` backend that never reads the cache
through block tables (``pdserve.engine.layers.attention``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.layers.native_switch import native, native_max_keys
from pdserve.kernels import load_prefill_attention


def causal_attention(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_rep: int,
                     scale: float, masks: list[torch.Tensor | None] | None = None, index: int = 0) -> None:
    """Causal attention of query rows [Q, H, D] over key [L, H_kv, D] / value [L, H_kv, V] (L >= Q; row j
    sees keys 0 .. L - Q + j), written into ``out`` [Q, H, V] float32.

    Float32 rows whose head dims are multiples of 16 go through ``prefill_attention.cpp`` (tiled,
    online softmax: FlashAttention's scheme) where it measured faster than SDPA on this CPU, at this
    many keys, when the engine loaded (``pdserve.engine.layers.kernel_choice``); anything else, or no C++
    compiler, through SDPA. For SDPA a chunk after cached rows (L > Q)
    needs an explicit [Q, L] mask: it is kept in ``masks[index]`` and reused by later layers."""
    num_q, num_heads, head_dim = query.shape
    num_k, num_kv_heads, v_dim = value.shape
    lib = load_prefill_attention() if query.dtype == key.dtype == value.dtype == torch.float32 and \
        head_dim % 16 == 0 and v_dim % 16 == 0 and query.device.type == "cpu" and native("prefill_attention") \
        and ((limit := native_max_keys(num_q == num_k)) is None or num_k <= limit) else None
    if lib is not None and query.stride(-1) == key.stride(-1) == value.stride(-1) == out.stride(-1) == 1:
        with torch.profiler.record_function("pdserve::prefill_attention"):
            rc = lib.pdserve_prefill_attention(
                out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), num_q, num_k, num_heads,
                num_kv_heads, head_dim, v_dim, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                value.stride(0), value.stride(1), out.stride(0), out.stride(1), scale, torch.get_num_threads())
        if rc == 0:
            return
    mask = None
    if num_k > num_q:
        if masks[index] is None:  # built once per forward: every layer's is the same
            masks[index] = torch.ones(num_q, num_k, dtype=torch.bool, device=query.device).tril(num_k - num_q)
        mask = masks[index]
    out.copy_(causal_sdpa(query, key, value, num_rep, scale, mask))


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_rep: int, scale: float,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of query rows [Q, H, D] over key [L, H_kv, D] / value [L, H_kv, V] -> [Q, H, V]: causal
    (``mask`` None, Q == L), or under ``mask`` [Q, L] (True: attend). Inputs are 4-D with the KV heads
    repeated: that is what reaches torch's flash kernel on CPU (3-D inputs or ``enable_gqa`` fall
    back to the math path, 3-4x slower on a 512-token prompt)."""
    q_s = query.transpose(0, 1)[None]  # (1, H, Q, D)
    k_s = key.transpose(0, 1).to(query.dtype).repeat_interleave(num_rep, 0)[None]  # (1, H, L, D)
    v_s = value.transpose(0, 1).to(query.dtype).repeat_interleave(num_rep, 0)[None]
    o_s = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o_s[0].transpose(0, 1)  # (Q, H, V)
