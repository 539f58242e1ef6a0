"""The panel kernel and its weight layout (``--linear-weight-format panel``, ``pdserve.engine.layers.panel_linear``).

Float32 weights are packed once into 16-feature column panels and every matmul of theirs runs through
the kernel: F.linear's outputs (to float rounding) at any row count, block and panel tail, a row's
outputs the same bits whatever the batch, no plain copy kept, transformers' tokens through the compiled
decode step, and ``auto`` weighing the layout against the others.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers import panel_linear
from pdserve.engine.layers.base import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.layers.weight_format import (choose_linear_weight_format, pack_lm_head, pack_model,
                                                 pack_panel_weights, place_in_arenas)
from tests.checkpoints import assert_packed_llm_gives_transformers_tokens

pytestmark = pytest.mark.skipif(not panel_linear.build_kernel(), reason="no C++ compiler to build the kernel")


# Rows: one, a few, one full block (28 on AVX-512), one past it (two blocks), several blocks with a short
# last one, and prompt row counts where AVX-512 takes two panels at a time (from 192 rows: blocks of 12, a last
# block of one row at 193, an odd last panel alone). Features: under one panel, a panel and a tail. Inputs:
# under a vector, odd, a prompt's width.
@pytest.mark.parametrize("rows", [1, 3, 16, 28, 29, 57, 193, 300])
@pytest.mark.parametrize("out_features,in_features", [(5, 7), (17, 64), (100, 300)])
def test_kernel_computes_f_linear_and_a_rows_outputs_do_not_depend_on_the_batch(rows, out_features, in_features):
    """The kernel's [M, N] equals F.linear's to float32 rounding; each row's outputs are bit-identical to
    that row computed alone (every output sums its products in the same order in any block)."""
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    panels = panel_linear.pack_panels(weight)
    assert panels.shape == ((out_features + 15) // 16, in_features, 16)
    y = panel_linear.panel_linear(x, panels, out_features)
    torch.testing.assert_close(y, F.linear(x, weight), atol=1e-4, rtol=1e-4)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(panel_linear.panel_linear(x[i:i + 1], panels, out_features), y[i:i + 1])


def test_pack_panels_refuses_what_it_cannot_take():
    """Only 2-D float32 CPU weights pack; the op refuses panels of another shape."""
    with pytest.raises(ValueError, match="float32"):
        panel_linear.pack_panels(torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        panel_linear.pack_panels(torch.randn(4))
    panels = panel_linear.pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.pdserve.panel_linear(torch.randn(3, 9), panels, 20)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.pdserve.panel_linear(torch.randn(3, 8), panels, 40)


def test_packed_layers_compute_what_the_plain_weights_do_and_keep_no_copy():
    """A fused column-parallel layer with a bias and a row-parallel one, at a decode step's rows, an odd
    count, a prefill's and a 3-D input: the panel outputs equal the plain ones, the plain weight's memory
    is gone (its shape and dtype stay), packing twice changes nothing, and bfloat16 layers stay plain."""
    torch.manual_seed(0)
    column = ColumnParallelLinear(64, [96, 40], bias=True)
    row = RowParallelLinear(128, 64)
    bf16 = RowParallelLinear(64, 32, dtype=torch.bfloat16)
    for layer in (column, row, bf16):
        torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(column.bias, std=0.05)
    xs = [torch.randn(n, 64) for n in (1, 7, 300)] + [torch.randn(2, 5, 64)]
    row_in = [torch.randn(*x.shape[:-1], 128) for x in xs]
    with torch.inference_mode():
        want = [(column(x), row(r)) for x, r in zip(xs, row_in)]
    model = torch.nn.ModuleDict({"column": column, "row": row, "bf16": bf16})
    assert pack_panel_weights(model) == 2
    assert pack_panel_weights(model) == 0  # already packed
    assert bf16.panel_weight is None
    for layer, shape in ((column, (136, 64)), (row, (64, 128))):
        assert layer.panel_weight is not None and layer.packed_weight is None
        assert layer.weight.shape == shape and layer.weight.dtype == torch.float32
        assert layer.weight.untyped_storage().nbytes() <= 4  # one element, viewed at every index
    with torch.inference_mode():
        for x, r, (want_column, want_row) in zip(xs, row_in, want):
            torch.testing.assert_close(column(x), want_column, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(row(r), want_row, atol=1e-5, rtol=1e-4)


def test_a_models_panels_lie_back_to_back_in_one_arena_on_huge_pages():
    """A decode step streams every panel once: the layers' panels are one arena that starts on a 2 MiB
    boundary (advised onto transparent huge pages), in the modules' order, each a contiguous view."""
    torch.manual_seed(0)
    layers = [ColumnParallelLinear(256, [1024, 512]), RowParallelLinear(1536, 256), RowParallelLinear(256, 2000)]
    for layer in layers:
        torch.nn.init.normal_(layer.weight, std=0.05)
    model = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
    plain = [layer.weight.detach().clone() for layer in layers]
    assert pack_panel_weights(model) == 3
    panels = [layer.panel_weight for layer in layers]
    base = panels[0].data_ptr()
    assert base % (2 << 20) == 0
    offset = 0
    for p, w in zip(panels, plain):
        assert p.is_contiguous() and p.shape == panel_linear.panels_shape(*w.shape)
        assert p.data_ptr() == base + offset
        assert p.untyped_storage().data_ptr() == panels[0].untyped_storage().data_ptr()
        offset += p.numel() * 4
        torch.testing.assert_close(panel_linear.panel_linear(torch.eye(w.shape[1]), p, w.shape[0]), w.t())
    # Whether Linux then backs the arena with huge pages is its call (after a long run memory may be too
    # fragmented for one): not asserted here; docs/benchmarks.md shows what it did (smaps, AnonHugePages).


def test_weights_move_into_arenas_before_loading_and_packed_ones_give_their_pages_back():
    """``place_in_arenas`` (run on a model just built, before its checkpoint is read): the decoder linears'
    weights one arena, the embedding another, each starting on a 2 MiB boundary, values kept, a tied
    parameter moved once, small ones left; a weight packed later hands its pages back (they read as zeros
    now), and the packed layers still compute the plain weights' outputs."""
    torch.manual_seed(0)
    lm = torch.nn.Module()
    lm.column = ColumnParallelLinear(256, [1024, 512])
    lm.row = RowParallelLinear(2048, 256)
    lm.small = RowParallelLinear(64, 32)
    lm.embed = torch.nn.Embedding(4096, 128)
    lm.head = lm.embed  # tied
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.05)
    values = {name: p.detach().clone() for name, p in lm.named_parameters()}
    small = lm.small.weight.data_ptr()
    assert place_in_arenas(lm) == (1536 * 256 + 256 * 2048 + 4096 * 128) * 4
    assert lm.column.weight.data_ptr() % (2 << 20) == 0 and lm.embed.weight.data_ptr() % (2 << 20) == 0
    assert lm.row.weight.data_ptr() == lm.column.weight.data_ptr() + 1536 * 256 * 4
    assert lm.small.weight.data_ptr() == small and lm.head.weight is lm.embed.weight
    for name, p in lm.named_parameters():
        assert torch.equal(p, values[name]), name
    x = torch.randn(3, 2048)
    want = torch.nn.functional.linear(x, values["row.weight"])
    plain = lm.row.weight
    assert pack_panel_weights(lm) == 3
    assert torch.count_nonzero(plain) == 0  # its pages went back to the kernel
    torch.testing.assert_close(lm.row(x), want, atol=1e-5, rtol=1e-4)


def test_only_an_untied_float32_lm_head_is_packed_in_panels():
    """An untied float32 head is packed (its logits equal the plain weight's, no plain copy kept); a tied
    head, a bfloat16 one and one already packed are left alone; an unknown layout is refused."""
    torch.manual_seed(0)

    def causal_lm(tied: bool, dtype=torch.float32) -> torch.nn.Module:
        lm = torch.nn.Module()
        lm.model = torch.nn.Module()
        lm.model.embed_tokens = torch.nn.Embedding(100, 32, dtype=dtype)
        lm.lm_head = lm.model.embed_tokens if tied else torch.nn.Embedding(100, 32, dtype=dtype)
        return lm

    assert not pack_lm_head(causal_lm(tied=True), "panel")
    assert not pack_lm_head(causal_lm(tied=False, dtype=torch.bfloat16), "panel")
    untied = causal_lm(tied=False)
    x = torch.randn(3, 32)
    want = F.linear(x, untied.lm_head.weight.detach())
    assert pack_lm_head(untied, "panel")
    assert not pack_lm_head(untied, "panel") and not pack_lm_head(untied, "onednn")  # already packed
    assert untied.lm_head.weight.untyped_storage().nbytes() <= 4
    torch.testing.assert_close(panel_linear.panel_linear(x, untied.lm_head.panel_weight, 100), want,
                               atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="panel"):
        pack_lm_head(untied, "mkl")
    with pytest.raises(ValueError, match="panel"):
        pack_model(untied, "plain")


def test_llm_on_panel_weights_gives_transformers_tokens(model_dir):
    """The tiny model with every decoder linear and its LM head in panels (prefill steps eager, decode
    steps compiled, the panels graph inputs): transformers' greedy tokens, and logprobs within 1e-4."""
    assert_packed_llm_gives_transformers_tokens(model_dir, "panel")


def test_auto_weighs_panels_against_the_other_layouts(monkeypatch):
    """``choose_linear_weight_format`` times panels beside plain and oneDNN and says so; a panel kernel made
    slow loses to the others, and the others made slow lose to it. Timing packs nothing. Without AVX-512
    panels are not timed at all (written for its 32 registers, they ran 3-8x slower on AVX2); this test
    times them on any CPU, as on an AVX-512 one."""
    model = torch.nn.ModuleDict({"a": ColumnParallelLinear(256, [512]), "b": RowParallelLinear(512, 256)})
    monkeypatch.setattr("pdserve.engine.layers.weight_format.builds_avx512", lambda: False)
    choice, why = choose_linear_weight_format(model)
    assert choice != "panel" and "panels are written for AVX-512" in why
    monkeypatch.setattr("pdserve.engine.layers.weight_format.builds_avx512", lambda: True)
    choice, why = choose_linear_weight_format(model)
    assert choice in ("plain", "onednn", "panel") and "panel" in why

    def slowed(fn):
        def slow(*args, **kwargs):
            time.sleep(0.002)
            return fn(*args, **kwargs)
        return slow

    real_panel = panel_linear.panel_linear
    monkeypatch.setattr(panel_linear, "panel_linear", slowed(real_panel))
    assert choose_linear_weight_format(model)[0] != "panel"
    monkeypatch.setattr(panel_linear, "panel_linear", real_panel)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", slowed(torch.ops.mkldnn._linear_pointwise))
    monkeypatch.setattr("pdserve.engine.layers.weight_format.linear", slowed(F.linear))
    assert choose_linear_weight_format(model)[0] == "panel"
    assert all(layer.panel_weight is None and layer.packed_weight is None for layer in model.values())


def test_the_cpp_operators_compute_what_their_python_implementations_do_and_refuse_a_freed_handle():
    """Where ``kernels.load_torch_ops`` builds, ``panel_linear_by_handle`` and ``decode_linear`` have C++ CPU
    kernels (torch_ops.cpp) that call the same native kernels as their Python implementations: the same
    bits, for float32 and bfloat16; a handle whose panels were freed is refused, not read."""
    from pdserve.engine.layers import decode_linear
    from pdserve.kernels import load_torch_ops

    if not (panel_linear.build_kernel() and decode_linear.build_kernel()) or load_torch_ops() is None:
        pytest.skip("the kernels or the C++ operators cannot be built here")
    for op in ("panel_linear_by_handle", "decode_linear"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pdserve::{op}", "CPU")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 256, generator=gen)
    panels = panel_linear.pack_panels(weight)
    handle = panel_linear.register_panels(panels)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256, generator=gen)
        got = torch.ops.pdserve.panel_linear_by_handle(x, handle, 70)
        assert torch.equal(got, panel_linear._panel_linear_by_handle_cpu(x, handle, 70))
        torch.testing.assert_close(got, x @ weight.t(), rtol=1e-5, atol=1e-4)
        for dtype in (torch.float32, torch.bfloat16):
            xd, wd = x.to(dtype), weight[:64].to(dtype)
            assert torch.equal(torch.ops.pdserve.decode_linear(xd, wd), decode_linear._decode_linear_cpu(xd, wd))
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.pdserve.panel_linear_by_handle(torch.randn(2, 128), handle, 70)
    del panels
    with pytest.raises(RuntimeError, match="no panels under handle"):
        torch.ops.pdserve.panel_linear_by_handle(x, handle, 70)
