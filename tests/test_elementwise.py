"""The one-pass RMSNorm, SwiGLU and RoPE kernels (``pdserve.engine.layers.elementwise``) against the torch code
they replace in eager forwards (which is also what the model-vs-transformers tests run through them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers import elementwise
from pdserve.kernels import load_elementwise
from pdserve.engine.layers.base import RMSNorm, SiluAndMul
from pdserve.engine.layers.rotary import RotaryEmbedding, _rotate
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(load_elementwise() is None, reason="no C++ compiler: the kernels are off")


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _both_thread_counts(fn):
    """``fn()`` on one thread and on two: the two results, which must be the same bits."""
    outs = []
    for n in (1, 2):
        with torch_threads(n):
            outs.append(fn())
    assert torch.equal(outs[0], outs[1])
    return outs[0]


@pytest.mark.parametrize("rows,hidden", [(1, 16), (7, 50), (300, 768), (2048, 64)])
def test_rms_norm_matches_torch(rows, hidden):
    torch.manual_seed(rows)
    wide = 3 * torch.randn(rows, hidden + 5)  # a strided view: rows longer than hidden
    x, weight = wide[:, :hidden], torch.randn(hidden)
    out = _both_thread_counts(lambda: elementwise.rms_norm(x, weight, 1e-5))
    torch.testing.assert_close(out, _torch_rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data.copy_(weight)
    torch.testing.assert_close(norm(x.reshape(rows, 1, hidden)), out.view(rows, 1, hidden))  # 3-D through the layer


@pytest.mark.parametrize("rows,d", [(1, 16), (5, 40), (288, 2048)])
def test_silu_and_mul_matches_torch(rows, d):
    torch.manual_seed(d)
    x = 6 * torch.randn(rows, 2 * d)
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # the exp's clamps: silu(-100) ~ 0, silu(100) = 100
    out = _both_thread_counts(lambda: elementwise.silu_and_mul(x))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(SiluAndMul()(x), out)


@pytest.mark.parametrize("rotary_dim,head_dim", [(64, 64), (32, 64), (16, 48)])
def test_rope_matches_torch(rotary_dim, head_dim):
    """Full and partial rotary dims, on q and k as strided views of a fused QKV output, left unchanged."""
    torch.manual_seed(rotary_dim + head_dim)
    n, heads, kv_heads = 37, 6, 2
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim)
    before = qkv.clone()
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim)
    positions = torch.arange(100, 100 + n)
    rope = RotaryEmbedding(head_dim, 10000.0, None, rotary_dim=rotary_dim)
    freqs = positions.float()[:, None] * rope.inv_freq[None, :]
    cos = torch.cat((freqs, freqs), -1).cos()[:, None, :]
    sin = torch.cat((freqs, freqs), -1).sin()[:, None, :]
    want_q, want_k = q.clone(), k.clone()
    for t in (want_q, want_k):
        t[..., :rotary_dim] = _rotate(t[..., :rotary_dim].clone(), cos, sin)
    got_q = _both_thread_counts(lambda: elementwise.rope_rotate_half(q, freqs.cos(), freqs.sin()))
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv, before)  # the inputs are left as they were


def test_kernels_step_aside_where_they_do_not_apply():
    """bfloat16 and tensors that need gradients take the torch path."""
    x = torch.randn(4, 32)
    assert elementwise.rms_norm(x.bfloat16(), torch.ones(32).bfloat16(), 1e-6) is None
    assert elementwise.rope_rotate_half(x.view(4, 2, 16).bfloat16(), torch.ones(4, 8), torch.zeros(4, 8)) is None
    assert elementwise.silu_and_mul(x.requires_grad_()) is None
