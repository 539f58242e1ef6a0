"""oneDNN-packed linear weights (``--linear-weight-format onednn``, the prefill workers' default).

The decoder's linear weights are reordered once at load into oneDNN's blocked layout and every
matmul of theirs runs through oneDNN: the same outputs as the plain weights (to float rounding),
no plain copy kept, transformers' greedy tokens, and prefill workers (only they) pack by default.
"""

from __future__ import annotations

import argparse
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.layers import onednn_linear
from pdserve.engine.layers.base import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.layers.weight_format import choose_linear_weight_format, pack_linear_weights, pack_lm_head, pick_layout
from tests.checkpoints import assert_packed_llm_gives_transformers_tokens, greedy_reference

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_compute_what_the_plain_weights_do_and_keep_no_copy(dtype):
    """A fused column-parallel layer with a bias and a row-parallel one, at a decode step's rows, an odd
    count and a prefill's: the packed outputs equal the plain ones to the dtype's rounding, the plain
    weight's memory is gone (its shape and dtype stay), and packing twice changes nothing."""
    torch.manual_seed(0)
    column = ColumnParallelLinear(64, [96, 32], bias=True, dtype=dtype)
    row = RowParallelLinear(128, 64, dtype=dtype)
    for layer in (column, row):
        torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(column.bias, std=0.05)
    xs = [torch.randn(n, 64, dtype=dtype) for n in (1, 7, 300)] + [torch.randn(2, 5, 64, dtype=dtype)]

    def row_input(x):  # the same row-parallel input for x's rows, before and after packing
        return torch.randn(*x.shape[:-1], 128, dtype=dtype, generator=torch.Generator().manual_seed(1))

    with torch.inference_mode():
        want = [(column(x), row(row_input(x))) for x in xs]
    model = torch.nn.ModuleDict({"column": column, "row": row})
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN reorders bfloat16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT: the layers stay plain
        assert pack_linear_weights(model) == 0 and getattr(column, "packed_weight", None) is None
        return
    assert pack_linear_weights(model) == 2
    assert pack_linear_weights(model) == 0  # already packed
    for layer, shape in ((column, (128, 64)), (row, (64, 128))):
        assert layer.packed_weight is not None
        assert layer.weight.shape == shape and layer.weight.dtype == dtype
        assert layer.weight.untyped_storage().nbytes() <= dtype.itemsize  # one element, viewed at every index
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    with torch.inference_mode():
        for x, (want_column, want_row) in zip(xs, want):
            torch.testing.assert_close(column(x), want_column, **tol)
            torch.testing.assert_close(row(row_input(x)), want_row, **tol)


def test_only_an_untied_lm_head_is_packed():
    """An untied head is packed (its logits equal the plain weight's, no plain copy kept); a head tied
    to the embedding is left alone, as is one already packed."""
    torch.manual_seed(0)

    def causal_lm(tied: bool) -> torch.nn.Module:
        lm = torch.nn.Module()
        lm.model = torch.nn.Module()
        lm.model.embed_tokens = torch.nn.Embedding(100, 32)
        lm.lm_head = lm.model.embed_tokens if tied else torch.nn.Embedding(100, 32)
        return lm

    tied = causal_lm(tied=True)
    assert not pack_lm_head(tied) and getattr(tied.lm_head, "packed_weight", None) is None
    untied = causal_lm(tied=False)
    x = torch.randn(3, 32)
    want = torch.nn.functional.linear(x, untied.lm_head.weight.detach())
    assert pack_lm_head(untied)
    assert not pack_lm_head(untied)  # already packed
    assert untied.lm_head.weight.shape == (100, 32) and untied.lm_head.weight.untyped_storage().nbytes() <= 4
    torch.testing.assert_close(onednn_linear.packed_linear(x, untied.lm_head, None), want, atol=1e-5, rtol=1e-4)


def test_llm_on_packed_weights_gives_transformers_tokens(model_dir):
    """The tiny model with every decoder linear and its LM head packed (prefill steps eager, decode steps
    compiled, both through oneDNN; the compiled graph reaches the packed weights by handle):
    transformers' greedy tokens, and logprobs within 1e-4."""
    assert_packed_llm_gives_transformers_tokens(model_dir, "onednn")


def test_auto_means_timed_at_load_for_every_role_and_onednn_for_a_prefill_worker_of_several_ranks(monkeypatch):
    """``auto`` is left to the load-time choice for a prefill worker, a decode worker and ``LLM`` alike
    (``$PDSERVE_LINEAR_WEIGHT_FORMAT`` where set, as the tests set ``plain``); a prefill worker of several
    ranks, whose ranks would each time on their own, packs in oneDNN and its other ranks get that on their
    command line; the role is the config's; a bad name or role is refused."""
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--model", "m"])
    assert EngineConfig.from_cli_args(args, role="prefill").linear_weight_format == "plain"  # conftest's pin
    assert EngineConfig.from_cli_args(args, role="decode").linear_weight_format == "plain"
    monkeypatch.delenv("PDSERVE_LINEAR_WEIGHT_FORMAT")
    assert EngineConfig.from_cli_args(args, role="prefill").linear_weight_format == "auto"
    assert EngineConfig.from_cli_args(args, role="decode").linear_weight_format == "auto"
    assert EngineConfig(model="m").linear_weight_format == "auto"
    assert [EngineConfig.from_cli_args(args, role=r).role for r in ("prefill", "decode", None)] == \
        ["prefill", "decode", None]
    explicit = parser.parse_args(["--model", "m", "--linear-weight-format", "plain"])
    assert EngineConfig.from_cli_args(explicit, role="prefill").linear_weight_format == "plain"
    config = EngineConfig.from_cli_args(parser.parse_args(["--model", "m", "--tensor-parallel-size", "2"]),
                                        role="prefill")
    assert config.linear_weight_format == "onednn"
    rank_args = config.rank_cli_args(1, "127.0.0.1", 29500)
    assert rank_args[rank_args.index("--linear-weight-format") + 1] == "onednn"
    with pytest.raises(ValueError, match="linear_weight_format"):
        EngineConfig(model="m", linear_weight_format="mkl")
    with pytest.raises(ValueError, match="role"):
        EngineConfig(model="m", role="router")


def test_a_prefill_worker_times_its_layouts_at_prompt_rows_and_prefills_transformers_tokens(model_dir, monkeypatch):
    """A prefill worker's ``auto`` times the layouts on its own weights at prompt-chunk rows only
    (``PREFILL_PROBE_ROWS``, not a decode batch's), packs what it chose, and its prompts' first tokens are
    transformers' greedy ones."""
    from pdserve.engine.core import EngineCore
    from pdserve.engine.layers.weight_format import PREFILL_PROBE_ROWS

    monkeypatch.setenv("PDSERVE_MEASURED_CHOICES", "off")
    prompts = [[5, 17, 42, 8, 99, 3, 12, 77, 41, 19] * 3, [7, 3, 99, 41] * 20]
    ref = greedy_reference(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompts, 1)
    core = EngineCore(EngineConfig(model=model_dir, role="prefill", linear_weight_format="auto", enforce_eager=True))
    try:
        runner = core.runner
        why = runner.plan.why["linear_weight_format"]
        assert why.startswith("timed at prompt rows")
        assert all(f" {n}: " in why for n in PREFILL_PROBE_ROWS) and " 1: " not in why and " 8: " not in why
        assert runner.linear_weight_format in ("plain", "onednn", "panel")
        assert runner.num_packed_linears == (4 * runner.num_layers if runner.linear_weight_format != "plain" else 0)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            core.add_request(f"p{i}", prompt, params)
        firsts = {}
        while core.has_unfinished():
            for out in core.step()[1]:
                firsts.setdefault(out.request.group_id, out.new_token_ids[0])
        assert [firsts[f"p{i}"] for i in range(len(prompts))] == [r[0][0] for r in ref]
    finally:
        core.close()


def test_auto_times_both_layouts_on_the_models_weights_and_takes_the_faster(model_dir, monkeypatch):
    """``auto`` on an engine that decodes: ``choose_linear_weight_format`` times the plain path, oneDNN (and
    panels, tests/test_panel_linear.py) on the model's own linears and says which and why; the engine packs
    exactly when it chose a packed layout, and either way gives transformers' tokens. The choice follows
    the timings: a oneDNN made slow loses."""
    monkeypatch.delenv("PDSERVE_LINEAR_WEIGHT_FORMAT")
    prompts = [[5, 17, 42, 8, 99, 3, 12, 77, 41, 19] * 3]
    ref = greedy_reference(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompts, 8)
    with LLM(model_dir) as llm:
        runner = llm.core.runner
        assert runner.linear_weight_format in ("plain", "onednn", "panel")
        assert runner.num_packed_linears == (4 * runner.num_layers if runner.linear_weight_format != "plain" else 0)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref[0][0]
    model = torch.nn.ModuleDict({"a": ColumnParallelLinear(256, [512]), "b": RowParallelLinear(512, 256)})
    choice, why = choose_linear_weight_format(model)
    assert choice in ("plain", "onednn", "panel") and "plain" in why and "oneDNN" in why
    real = torch.ops.mkldnn._linear_pointwise

    def slow(*args):
        time.sleep(0.002)
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", slow)
    assert choose_linear_weight_format(model)[0] != "onednn"
    assert all(layer.packed_weight is None for layer in model.values())  # timing packs nothing


def test_a_packed_layout_replaces_plain_only_when_clearly_faster():
    """``pick_layout`` on probe timings (ms of the bench preset's first 43 linears) taken on real machines:
    every row count weighs alike, and a packed layout must beat plain by ``PROBE_MARGIN``. On an Intel Xeon
    with AVX-512 panels came out 2% behind plain on the mean and lost in the whole decode step by 25%:
    plain must be kept there; where a packed layout is far ahead (a Zen 5's oneDNN) it is taken."""
    rows = (1, 8, 64)

    def timings(plain, onednn, panel):
        return {(layout, n): t for layout, ts in (("plain", plain), ("onednn", onednn), ("panel", panel))
                for n, t in zip(rows, ts)}

    xeon = timings((20.9, 23.5, 75.5), (22.7, 28.4, 67.5), (19.9, 26.6, 75.4))
    choice, slowdown = pick_layout(xeon, rows)
    assert choice == "plain" and slowdown["plain"] < slowdown["panel"] < slowdown["onednn"]
    # a packed layout ahead, but by less than the margin: plain stays
    close = timings((10.0, 10.0, 10.0), (9.8, 9.8, 9.8), (11.0, 11.0, 11.0))
    assert pick_layout(close, rows)[0] == "plain"
    # choose_linear_weight_format's Zen 5 figures (plain at 8 rows not recorded there: set near oneDNN's)
    zen5 = timings((9.6, 14.0, 105.0), (8.1, 13.7, 43.0), (8.3, 9.7, 46.0))
    assert pick_layout(zen5, rows)[0] == "panel"
    assert pick_layout({k: v for k, v in zen5.items() if k[0] != "panel"}, rows)[0] == "onednn"
