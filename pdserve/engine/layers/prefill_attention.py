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
    compiler, through SDPA. For SDPA a float32 chunk after enough cached rows (``splits``), on CPU, is
    split in two (``chunk_sdpa``: no mask; values as wide as keys); other chunks need an explicit [Q, L]
    mask, kept in ``masks[index]`` and reused by later layers."""
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
    if splits(num_q, num_k - num_q) and _FLASH_CPU is not None and query.device.type == "cpu" \
            and v_dim == head_dim and query.dtype == torch.float32:
        out.copy_(chunk_sdpa(query, key, value, num_rep, scale))
        return
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


# Where ``chunk_sdpa`` beats one masked SDPA call (measured on one Xeon core, AVX-512 and ATen capped at
# AVX2 alike): from twice the chunk's rows cached (256 rows after 512: 8-12% faster, after 1,792: 20-23%),
# and for chunks of 512 rows or more from half their rows cached (512 after 256: 5%, after 512: 12-16%,
# 1,024 after 1,024: 32%); 256 rows after 256 and 384 after 384 are level or up to 20% slower split, and
# below 32 rows the second call is overhead.
SPLIT_MIN_CACHED_PER_ROW = 2
SPLIT_MIN_ROWS = 32
SPLIT_LONG_ROWS = 512  # a chunk this long splits from half its rows cached


def splits(num_rows: int, num_cached: int) -> bool:
    """Whether a chunk of ``num_rows`` new rows after ``num_cached`` cached ones takes ``chunk_sdpa``."""
    return num_rows >= SPLIT_MIN_ROWS and (num_cached >= SPLIT_MIN_CACHED_PER_ROW * num_rows
                                           or (num_rows >= SPLIT_LONG_ROWS and 2 * num_cached >= num_rows))


# torch's CPU flash-attention operator, which SDPA dispatches to on CPU and which also returns each row's
# log-sum-exp (what ``chunk_sdpa`` merges by); None in a torch without it (the masked SDPA path then).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunk_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_rep: int,
               scale: float) -> torch.Tensor:
    """Attention of a prefill chunk's rows query [Q, H, D] over key [L, H_kv, D] / value [L, H_kv, D]
    (torch's CPU flash kernel wants values as wide as keys), L > Q, the first L - Q rows cached (row j
    sees keys 0 .. L - Q + j) -> [Q, H, D] float32, on CPU.

    Two flash-attention calls instead of one under a [Q, L] mask: the rows over the cached keys, which
    every row sees whole (no mask; each KV head's ``num_rep`` query heads folded into its rows, so K/V are
    read as the cache holds them, never repeated), and the rows over their own keys (causal); the two
    partial results merge by their log-sum-exps, as split-KV attention merges its partitions
    (FlashDecoding; FlashAttention-2's online softmax across blocks). Same values as the masked call to
    float32 rounding; on one Xeon core (AVX-512), 12 query / 4 KV heads of 64, a 2,048-token prompt in
    256-row chunks: 61 ms a layer against 78-82 ms masked, the same as one causal call over the prompt."""
    num_q, num_heads, head_dim = query.shape
    num_k, num_kv_heads, v_dim = value.shape
    cached = num_k - num_q
    dtype = query.dtype
    q_fold = query.reshape(num_q, num_kv_heads, num_rep, head_dim).permute(1, 2, 0, 3) \
        .reshape(1, num_kv_heads, num_rep * num_q, head_dim)  # (1, H_kv, rep * Q, D): head h = kv * rep + r
    out_c, lse_c = _FLASH_CPU(q_fold, key[:cached].transpose(0, 1).to(dtype)[None],
                              value[:cached].transpose(0, 1).to(dtype)[None], scale=scale)
    q_s = query.transpose(0, 1)[None]  # (1, H, Q, D)
    k_s = key[cached:].transpose(0, 1).to(dtype).repeat_interleave(num_rep, 0)[None]  # (1, H, Q, D)
    v_s = value[cached:].transpose(0, 1).to(dtype).repeat_interleave(num_rep, 0)[None]
    out_n, lse_n = _FLASH_CPU(q_s, k_s, v_s, is_causal=True, scale=scale)  # (1, H, Q, V), (1, H, Q)
    out_c = out_c.reshape(num_heads, num_q, v_dim).float()
    lse_c = lse_c.reshape(num_heads, num_q)
    lse_n = lse_n[0]
    lse = torch.logaddexp(lse_c, lse_n)  # (H, Q)
    merged = out_c.mul_((lse_c - lse).exp_().unsqueeze(-1))
    merged.addcmul_(out_n[0].float(), (lse_n - lse).exp_().unsqueeze(-1))
    return merged.transpose(0, 1)  # (Q, H, V)
