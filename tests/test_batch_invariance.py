"""--batch-invariant: a request's tokens and logprobs have the same bits whatever else is in the
batch and however its prefill is chunked (He & Thinking Machines Lab, "Defeating Nondeterminism
in LLM Inference", 2025)."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.config import EngineConfig
from pdserve.engine.layers.base import INVARIANT_ROW_MULTIPLE, RMSNorm, SiluAndMul, batch_invariant_linear, pad_rows
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.llm import LLM
from tests.helpers.kernels import _ROW_PLACES, _TARGET, _target_prompt, _runs, _distinct_rows  # noqa: F401


@pytest.mark.parametrize("in_features,out_features", [(64, 192), (176, 64), (256, 640)])
def test_invariant_linear_gives_a_row_the_same_bits_at_any_batch_size(in_features, out_features):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features)
    assert _distinct_rows(lambda x: batch_invariant_linear(x, weight, bias), in_features) == 1
    x = torch.randn(5, in_features)
    torch.testing.assert_close(batch_invariant_linear(x, weight, bias), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)
    assert batch_invariant_linear(x[None], weight).shape == (1, 5, out_features)


def test_padding_rounds_rows_up():
    m = INVARIANT_ROW_MULTIPLE
    for num_rows, padded in ((1, m), (m - 1, m), (m + 1, 2 * m), (3 * m, 3 * m)):
        x = torch.randn(num_rows, 8)
        out = pad_rows(x)
        assert out.shape == (padded, 8)
        assert torch.equal(out[:num_rows], x) and not out[num_rows:].any()
    x = torch.randn(2 * m, 8)
    assert pad_rows(x) is x  # no copy when nothing is padded


def test_per_token_ops_are_already_invariant():
    """RMSNorm, SwiGLU, log-softmax and softmax (the sampler's) reduce each row on its own."""
    assert _distinct_rows(RMSNorm(64), 64) == 1
    assert _distinct_rows(SiluAndMul(), 352) == 1
    assert _distinct_rows(lambda x: x.log_softmax(-1), 2048) == 1
    assert _distinct_rows(lambda x: x.softmax(-1), 2048) == 1
    rope = RotaryEmbedding(16, 10000.0)
    q_row, k_row = torch.randn(4, 16), torch.randn(2, 16)
    seen = set()
    for m, pos in _ROW_PLACES:
        q, k = torch.randn(m, 4, 16), torch.randn(m, 2, 16)
        q[pos], k[pos] = q_row, k_row
        positions = torch.randint(0, 500, (m,))
        positions[pos] = 77
        q_out, k_out = rope(positions, q, k)
        seen.add(q_out[pos].numpy().tobytes() + k_out[pos].numpy().tobytes())
    assert len(seen) == 1


def test_config_refuses_what_cannot_be_invariant(model_dir):
    with pytest.raises(ValueError, match="paged attention kernel"):
        EngineConfig(model=model_dir, batch_invariant=True, attention_backend="reference")
    with pytest.raises(ValueError, match="tensor_parallel_size <= 2"):
        EngineConfig(model=model_dir, batch_invariant=True, tensor_parallel_size=4)


def test_engine_refuses_the_flag_without_the_kernel(model_dir, monkeypatch):
    """Where the kernel cannot run (CUDA, no compiler, $PDSERVE_DISABLE_KERNELS) auto picks reference."""
    import pdserve.engine.execution.model_runner as model_runner

    monkeypatch.setattr(model_runner, "select_backend", lambda *args, **kwargs: "reference")
    with pytest.raises(ValueError, match="--batch-invariant needs the paged attention kernel"):
        LLM(model_dir, batch_invariant=True, num_threads=1)


def test_flag_reaches_the_config_and_the_other_ranks(model_dir):
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(["--model", model_dir, "--batch-invariant"]))
    assert config.batch_invariant
    assert "--batch-invariant" in config.rank_cli_args(1, "127.0.0.1", 1234)
    assert not EngineConfig.from_cli_args(parser.parse_args(["--model", model_dir])).batch_invariant


def test_one_request_is_bit_identical_among_any_traffic(model_dir):
    """40 runs with different neighbours and chunkings, plus the request alone (unchunked, then
    a prefix-cache hit): one completion, one set of logprobs, bit for bit (floats compare
    exactly here)."""
    with LLM(model_dir, batch_invariant=True, enable_prefix_caching=False, seed=0, num_threads=1) as llm:
        assert llm.core.runner.model.batch_invariant
        results = _runs(llm, 40, seed=3)
    with LLM(model_dir, batch_invariant=True, seed=0, num_threads=1) as alone:
        prompt = _target_prompt(alone.vocab_size)
        for _ in range(2):  # a fresh prefill in one step, then from the prefix cache
            choice = alone.generate([prompt], _TARGET, use_tqdm=False)[0].outputs[0]
            results.append((tuple(choice.token_ids), tuple(
                (lp.token_id, lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs))
                for lp in choice.logprobs)))
    assert len({tokens for tokens, _ in results}) == 1
    assert len(set(results)) == 1


def test_without_the_flag_the_same_traffic_changes_the_bits(model_dir):
    """The control: the harness above does see batching's effect when the flag is off."""
    with LLM(model_dir, enable_prefix_caching=False, seed=0, num_threads=1) as llm:
        results = _runs(llm, 5, seed=3)
    assert len({logprobs for _, logprobs in results}) > 1
