"""Rotary position embedding (RoPE) and the scaling kinds checkpoints use: ``llama3``, ``linear``,
``yarn``, ``longrope`` and ``dynamic`` (``RotaryEmbedding``; each kind's paper in its function)."""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.layers.elementwise import rope_rotate_half


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: keep high frequencies, divide low ones by ``factor``,
    and interpolate smoothly in between (Meta's Llama 3.1 reference code)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_mid, blended, out)


def _yarn_inv_freq(rope_theta: float, rotary_dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models", 2023):
    (inv_freq [R/2], attention_factor). Dimensions that turn more than ``beta_fast`` times over
    the original context keep their frequency (extrapolation), those turning fewer than
    ``beta_slow`` times are divided by ``factor`` (interpolation), with a linear ramp between;
    cos/sin are scaled by ``attention_factor`` (default 0.1 ln(factor) + 1, or DeepSeek's
    ratio of ``mscale`` / ``mscale_all_dim`` terms)."""
    factor = float(scaling["factor"])
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("yarn RoPE scaling needs original_max_position_embeddings")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dimension turning num_rotations times
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    pos_freqs = rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def _longrope_params(rotary_dim: int, scaling: dict, max_position_embeddings: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """LongRoPE (Ding et al., "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens", 2024),
    as Phi-3's 128k configs give it: (short_factor [R/2], long_factor [R/2], original_max_position_embeddings,
    attention_factor). Each frequency is divided by its own rescale factor; attention_factor (cos/sin are
    scaled by it, whichever factor list is used) is the config's, else sqrt(1 + ln(s) / ln(original)) with
    s = ``factor`` or max_position_embeddings / original (1 when s <= 1), as transformers computes it."""
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("longrope RoPE scaling needs original_max_position_embeddings")
    lists = []
    for name in ("short_factor", "long_factor"):
        values = scaling.get(name)
        if values is None or len(values) != rotary_dim // 2:
            raise ValueError(f"longrope RoPE scaling needs {name} with rotary_dim / 2 = {rotary_dim // 2} "
                             f"values, got {None if values is None else len(values)}")
        lists.append(torch.tensor(values, dtype=torch.float32))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling.get("factor")
        if factor is None:
            if max_position_embeddings is None:
                raise ValueError("longrope RoPE scaling needs factor or max_position_embeddings")
            factor = max_position_embeddings / original
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return lists[0], lists[1], int(original), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, RoPE (Su et al., "RoFormer", 2021), rotate-half convention as in HF.

    forward(positions [num_tokens], query [num_tokens, num_heads, head_dim],
    key [num_tokens, num_kv_heads, head_dim], attn_metadata=None) -> rotated (query, key), same shapes
    and dtypes. cos/sin are computed in float32 from the positions on each call (no max-length table).
    ``rotary_dim`` (default head_dim): only the first ``rotary_dim`` features of each head
    rotate, the rest pass through (partial rotary, as Phi-3's ``partial_rotary_factor``).
    ``interleaved``: pairs of adjacent features rotate together (DeepSeek's ``rope_interleave``).
    rope_scaling: None, {"rope_type": "default"}, a llama3 dict, {"rope_type": "linear",
    "factor": f}, a yarn dict, a longrope dict or a dynamic dict; anything else raises
    NotImplementedError. ``max_position_embeddings`` (the model config's) is read by longrope (its
    default attention factor) and dynamic (the length below which nothing is rescaled).

    Two kinds depend on the length of the sequence, not only on the position
    (``length_scaling`` names them; None for the others, whose forward never reads ``attn_metadata``):

    * ``longrope`` (Ding et al., "LongRoPE", 2024; Phi-3-mini-128k, Phi-3.5, Phi-4-mini): the
      frequencies are divided by ``long_factor`` when the sequence is longer than
      ``original_max_position_embeddings``, else by ``short_factor``.
    * ``dynamic`` (dynamic NTK scaling, bloc97 and emozilla's "Dynamically Scaled RoPE" post on
      r/LocalLLaMA, 2023): a sequence of length L > M = max_position_embeddings takes the base
      theta * (factor * L / M - (factor - 1)) ** (R / (R - 2)); shorter ones keep theta.

    The length is taken per request, from ``attn_metadata`` (``AttentionMetadata.token_seq_lens``):
    a token's is its request's known length when the step runs (the whole prompt while any chunk of
    it computes; position + 1 in a decode step). That is what transformers does for one sequence
    (``dynamic_rope_update``: its forward's max(position_ids) + 1), so a request's ``generate`` alone
    is reproduced token for token, with its prompt prefilled in one step or in chunks; keys already
    cached keep the frequencies they were computed with (a sequence that grows past the original
    length has short-factor keys before and long-factor ones after). A request's tokens never see
    another request's length. transformers' Phi-3 ``generate`` (``prepare_inputs_for_generation``)
    also drops its cache on the step that first exceeds the original length and recomputes every key
    with the long factor; pdserve's scheduler does the same for Phi-3
    (``SchedulerConfig.recompute_past_len``), so that ``generate`` is matched too. vLLM instead decides from the positions alone: its
    ``Phi3LongRoPEScaledRotaryEmbedding`` (in the versions we read) takes the long factor for every
    token of a forward when any position in it exceeds the original length
    (``torch.any(positions > original)``), so a short request batched with a long one changes; we
    follow transformers, the reference implementation the model authors shipped and evaluated, per
    request so that batching changes nothing. A request recomputed after preemption takes its whole
    known length (as that Phi-3 ``generate`` recomputes). Because a block's K then depends on the
    length of the request that computed it, not only on its tokens, the engine turns prefix caching
    off for these two kinds (logged).
    Without ``attn_metadata`` all tokens count as one sequence (max(positions) + 1).
    transformers' dynamic kind also keeps a cached length across calls (``max_seq_len_cached``, reset
    when a forward is shorter than M); for a single growing sequence that is the stateless rule above.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None = None, device="cpu",
                 rotary_dim: int | None = None, interleaved: bool = False,
                 max_position_embeddings: int | None = None):
        super().__init__()
        self.interleaved = interleaved
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 != 0 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"RoPE needs an even rotary_dim in (0, head_dim={head_dim}], got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.partial = rotary_dim < head_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (rope_theta**exponents)  # (R/2,)
        rope_type = None
        if rope_scaling:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        self.attention_factor = 1.0  # cos and sin are scaled by it (YaRN, LongRoPE)
        self.length_scaling: str | None = None  # "longrope" or "dynamic": frequencies depend on the length
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(rope_theta, rotary_dim, rope_scaling)
        elif rope_type == "linear":  # position interpolation (Chen et al., 2023): positions / factor
            inv_freq = inv_freq / float(rope_scaling["factor"])
        elif rope_type == "longrope":
            short, long, self.original_max_len, self.attention_factor = _longrope_params(
                rotary_dim, rope_scaling, max_position_embeddings)
            pos_freqs = rope_theta**exponents
            inv_freq = 1.0 / (short * pos_freqs)
            self.register_buffer("long_inv_freq", (1.0 / (long * pos_freqs)).to(device), persistent=False)
            self.length_scaling = "longrope"
        elif rope_type == "dynamic":
            if max_position_embeddings is None:
                raise ValueError("dynamic RoPE scaling needs the model's max_position_embeddings")
            if rotary_dim < 4:
                raise ValueError(f"dynamic RoPE scaling needs rotary_dim >= 4, got {rotary_dim}")
            self.factor = float(rope_scaling["factor"])
            # Like transformers, the length below which nothing changes is max_position_embeddings (an
            # original_max_position_embeddings in the dict is not read by its dynamic kind).
            self.original_max_len = int(max_position_embeddings)
            self.rope_theta = float(rope_theta)
            self.register_buffer("exponents", exponents.to(device), persistent=False)
            m, f = self.original_max_len, self.factor  # the base at length M, in Python floats as transformers
            base = rope_theta * ((f * m / m) - (f - 1)) ** (rotary_dim / (rotary_dim - 2))
            inv_freq = 1.0 / (base**exponents)
            self.length_scaling = "dynamic"
        elif rope_type not in (None, "default"):
            raise NotImplementedError(f"RoPE scaling type {rope_type!r} is not supported (llama3, linear, yarn, "
                                      "longrope and dynamic are)")
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def _token_inv_freq(self, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        """[num_tokens, R/2] float32: each token's frequencies under a length-dependent kind."""
        if attn_metadata is not None:
            seq_lens = attn_metadata.token_seq_lens(positions)  # (N,) int64
        else:
            seq_lens = (positions.max() + 1).expand_as(positions)
        longer = (seq_lens > self.original_max_len)[:, None]  # (N, 1)
        if self.length_scaling == "longrope":
            return torch.where(longer, self.long_inv_freq[None, :], self.inv_freq[None, :])
        # dynamic NTK: float32 tensor arithmetic, in transformers' order
        length = torch.clamp(seq_lens, min=self.original_max_len)
        scale = (self.factor * length / self.original_max_len) - (self.factor - 1)  # (N,) float32
        base = self.rope_theta * scale ** (self.rotary_dim / (self.rotary_dim - 2))
        grown = 1.0 / (base[:, None] ** self.exponents[None, :])  # (N, R/2)
        return torch.where(longer, grown, self.inv_freq[None, :])

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, attn_metadata=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.length_scaling is None:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (N, R/2)
        else:
            freqs = positions.float()[:, None] * self._token_inv_freq(positions, attn_metadata)
        cos_h, sin_h = freqs.cos(), freqs.sin()  # (N, R/2): one entry per frequency
        if self.attention_factor != 1.0:
            cos_h, sin_h = cos_h * self.attention_factor, sin_h * self.attention_factor
        if self.interleaved:
            cos, sin = cos_h[:, None, :].to(query.dtype), sin_h[:, None, :].to(query.dtype)  # (N, 1, R/2)
            return _rotate_interleaved(query, cos, sin), _rotate_interleaved(key, cos, sin)

        def turn(x: torch.Tensor) -> torch.Tensor:
            if (out := rope_rotate_half(x, cos_h, sin_h)) is not None:  # float32 on the CPU, eager: one pass
                return out
            cos = torch.cat((cos_h, cos_h), dim=-1)[:, None, :].to(x.dtype)  # (N, 1, R)
            sin = torch.cat((sin_h, sin_h), dim=-1)[:, None, :].to(x.dtype)
            if self.partial:
                r = self.rotary_dim
                return torch.cat((_rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
            return _rotate(x, cos, sin)

        return turn(query), turn(key)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] whose pairs (x0, x1), (x2, x3), ... each turn by one frequency (cos, sin [N, 1, D/2]),
    DeepSeek's layout. Returns the rotated pairs de-interleaved, [evens', odds'], as HF does: q and k
    get the same permutation, so their dot products are those of the interleaved result."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] -> x*cos + rotate_half(x)*sin, where rotate_half(x) = cat(-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)  # (N, H, D/2) each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
