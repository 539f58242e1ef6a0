"""Native kernel or torch, chosen per machine by measurement at load (``pdserve.engine.layers.kernel_choice``), and
the kernels built for an instruction set below this CPU's (``$PDSERVE_KERNEL_ISA``)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from pdserve.engine.layers import decode_linear, elementwise, kernel_choice
from pdserve.kernels import load_decode_linear, load_elementwise, load_prefill_attention
from pdserve.engine.layers.base import RMSNorm, SiluAndMul
from pdserve.engine.layers.prefill_attention import causal_attention, causal_sdpa

pytestmark = pytest.mark.skipif(load_prefill_attention() is None or load_elementwise() is None
                                or load_decode_linear() is None, reason="no C++ compiler: nothing to choose")

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def restore_choices():
    """Every test leaves the process as it found it: every kernel native (the tests' ``all``)."""
    yield
    for kernel in kernel_choice.KERNELS:
        kernel_choice.set_native(kernel, True)


@pytest.fixture(scope="module")
def tiny_model(model_dir):
    from pdserve.engine.models.loader import load_model

    return load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))


def test_auto_keeps_the_faster_path_of_each_kernel_and_the_call_sites_follow(tiny_model, monkeypatch):
    """The probe's decision is the faster path's, kernel by kernel, and each call site then takes that
    path: with torch timed faster for prompt attention, ``causal_attention`` never calls the kernel; with
    the kernels faster for the rest, RMSNorm and the few-row matmul do."""
    fake = {"prefill_attention": {"native": 5.0, "torch": 1.0}, "elementwise": {"native": 1.0, "torch": 2.0},
            "decode_linear": {"native": 1.0, "torch": 3.0}}
    probing: list[str] = []
    real_toggled = kernel_choice._toggled

    def toggled(kernel, work):
        probing.append(kernel)
        paths = real_toggled(kernel, work)
        for run in paths.values():
            run()  # both paths really run once on the model's shapes
        return paths

    monkeypatch.setattr(kernel_choice, "_toggled", toggled)
    monkeypatch.setattr(kernel_choice, "_best_ms", lambda paths, repeats: fake[probing[-1]])
    choices = kernel_choice.choose_kernels(tiny_model, "auto", max_keys=512)
    assert {k: c.path for k, c in choices.items()} == {"prefill_attention": "torch", "elementwise": "native",
                                                      "decode_linear": "native"}
    assert choices["prefill_attention"].native_ms == 15.0 and choices["prefill_attention"].torch_ms == 3.0  # 3 shapes
    assert not kernel_choice.native("prefill_attention") and kernel_choice.native("elementwise")
    calls = []
    lib = load_prefill_attention()
    monkeypatch.setattr("pdserve.engine.layers.prefill_attention.load_prefill_attention", lambda: calls.append(1) or lib)
    q, k, v = torch.randn(32, 4, 16), torch.randn(32, 2, 16), torch.randn(32, 2, 16)
    out = torch.empty(32, 4, 16)
    causal_attention(out, q, k, v, 2, 0.25)
    assert not calls  # SDPA computed it
    torch.testing.assert_close(out, causal_sdpa(q, k, v, 2, 0.25))
    assert elementwise.rms_norm(torch.randn(3, 64), torch.ones(64), 1e-6) is not None
    assert decode_linear.kernel_applies(torch.randn(1, 64), torch.randn(32, 64))


def test_prompt_attention_takes_the_kernel_only_up_to_the_longest_length_it_won(tiny_model, monkeypatch):
    """Per shape, the kernel takes the lengths up to the longest at which it won at every shorter one:
    fresh prompts it won at 128 and 512 tokens and lost at 1,024 take it up to 512; chunks after cached
    rows it lost at the shortest never do. Lost everywhere: SDPA for every prompt."""
    from pdserve.engine.layers import prefill_attention

    probes = [("fresh", n) for n in kernel_choice.ATTENTION_FRESH] + \
        [("chunk", n) for n in kernel_choice.ATTENTION_CHUNK_KEYS]
    real_toggled = kernel_choice._toggled
    for wins, want in (({("fresh", 128), ("fresh", 512), ("chunk", 2048)}, ("native", 512, 0)),
                       (set(), ("torch", 0, 0)), (set(probes), ("native", None, None))):
        calls = []

        def toggled(kernel, work):
            calls.append(kernel)
            return real_toggled(kernel, work)

        def fake_best(paths, repeats):
            attention = [k for k in calls if k == "prefill_attention"]
            if calls[-1] != "prefill_attention":
                return {"native": 1.0, "torch": 2.0}
            won = probes[len(attention) - 1] in wins
            return {"native": 1.0, "torch": 2.0} if won else {"native": 2.0, "torch": 1.0}

        monkeypatch.setattr(kernel_choice, "_toggled", toggled)
        monkeypatch.setattr(kernel_choice, "_best_ms", fake_best)
        choice = kernel_choice.choose_kernels(tiny_model, "auto", max_keys=4096)["prefill_attention"]
        assert (choice.path, choice.max_keys, choice.max_chunk_keys) == want, choice.why
        assert kernel_choice.native_max_keys(True) == want[1] and kernel_choice.native_max_keys(False) == want[2]
    kernel_choice.set_native("prefill_attention", True)
    kernel_choice.set_native_max_keys(512, 100)
    calls = []
    lib = load_prefill_attention()
    monkeypatch.setattr(prefill_attention, "load_prefill_attention", lambda: calls.append(1) or lib)
    for rows, num_k, kernel in ((300, 300, True), (600, 600, False), (40, 90, True), (40, 300, False)):
        q, k, v = torch.randn(rows, 4, 16), torch.randn(num_k, 2, 16), torch.randn(num_k, 2, 16)
        out = torch.empty(rows, 4, 16)
        calls.clear()
        causal_attention(out, q, k, v, 2, 0.25, [None])
        assert bool(calls) == kernel, (rows, num_k)
        mask = torch.ones(rows, num_k, dtype=torch.bool).tril(num_k - rows)
        torch.testing.assert_close(out, causal_sdpa(q, k, v, 2, 0.25, mask), atol=1e-5, rtol=1e-5)
    kernel_choice.set_native_max_keys(None, None)


@pytest.mark.parametrize("kernel", kernel_choice.KERNELS)
def test_each_kernel_turned_off_runs_torch_and_computes_the_same(kernel):
    """Off, a kernel's call site computes through torch: the same results (to float rounding) as native."""
    torch.manual_seed(0)
    if kernel == "prefill_attention":
        q, k, v = torch.randn(70, 6, 32), torch.randn(70, 2, 32), torch.randn(70, 2, 32)

        def run():
            out = torch.empty(70, 6, 32)
            causal_attention(out, q, k, v, 3, 32 ** -0.5)
            return out
    elif kernel == "elementwise":
        norm, act = RMSNorm(48), SiluAndMul()
        norm.weight.data.normal_()
        x, gate_up = torch.randn(9, 48), torch.randn(9, 96)

        def run():
            return torch.cat([norm(x), act(gate_up)], dim=1)
    else:
        from pdserve.engine.layers.base import linear

        x, w = torch.randn(3, 64), torch.randn(40, 64)

        def run():
            return linear(x, w)
    with torch.inference_mode():
        native = run()
        kernel_choice.set_native(kernel, False)
        assert not kernel_choice.native(kernel)
        off = run()
    torch.testing.assert_close(off, native, atol=2e-5, rtol=1e-5)
    if kernel == "elementwise":
        assert elementwise.rms_norm(torch.randn(2, 48), norm.weight.data, 1e-6) is None
    if kernel == "decode_linear":
        assert not decode_linear.kernel_applies(torch.randn(1, 64), torch.randn(32, 64))


def test_all_runs_every_kernel_that_builds_and_auto_times_them(tiny_model):
    """``all``: every kernel native, reported as such, nothing timed. ``auto`` on the real timer: each
    choice names the path with the lesser time, and both paths were timed."""
    for kernel in kernel_choice.KERNELS:
        kernel_choice.set_native(kernel, False)
    choices = kernel_choice.choose_kernels(tiny_model, "all", max_keys=512)
    assert all(kernel_choice.native(k) for k in kernel_choice.KERNELS)
    assert {k: c.path for k, c in choices.items()} == dict.fromkeys(kernel_choice.KERNELS, "native")
    choices = kernel_choice.choose_kernels(tiny_model, "auto", max_keys=128)
    assert set(choices) == set(kernel_choice.KERNELS)
    for c in choices.values():
        assert c.native_ms > 0 and c.torch_ms > 0
        assert c.path == ("native" if c.native_ms <= c.torch_ms else "torch")
        assert kernel_choice.native(c.kernel) == (c.path == "native")
    with pytest.raises(ValueError, match="native_kernels"):
        kernel_choice.choose_kernels(tiny_model, "some", max_keys=128)


def test_an_engine_reports_its_choices(model_dir):
    """``LLM`` (and so every worker's registration, ``/workers``) carries the runner's choices."""
    from pdserve import LLM

    with LLM(model_dir, native_kernels="auto", kv_cache_memory="4MiB") as llm:
        choices = llm.core.runner.kernel_choices
    assert set(choices) == set(kernel_choice.KERNELS)
    assert all(c.path in ("native", "torch") and c.why for c in choices.values())


_ISA_CHECK = r"""
import torch
from pdserve import kernels
from pdserve.engine.layers.decode_linear import build_kernel, decode_linear_kernel
from pdserve.engine.layers.prefill_attention import causal_attention, causal_sdpa
assert kernels.compiler_flags()[-1] == kernels.KERNEL_ISAS[kernels.kernel_isa()]
assert build_kernel() and kernels.load_prefill_attention() is not None
torch.manual_seed(0)
for rows in (1, 3, 4, 7, 8, 13):
    x, w = torch.randn(rows, 96), torch.randn(50, 96)
    torch.testing.assert_close(decode_linear_kernel(x, w), x @ w.T, atol=1e-4, rtol=1e-4)
q, k, v = torch.randn(150, 8, 64), torch.randn(150, 2, 64), torch.randn(150, 2, 64)
out = torch.empty(150, 8, 64)
causal_attention(out, q, k, v, 4, 0.125)
torch.testing.assert_close(out, causal_sdpa(q, k, v, 4, 0.125), atol=1e-5, rtol=1e-5)
from pdserve.engine.layers import elementwise
x, w, gate_up = torch.randn(33, 80), torch.randn(80), torch.randn(33, 2 * 72)
torch.testing.assert_close(elementwise.rms_norm(x, w, 1e-6), w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
gate, up = gate_up.chunk(2, dim=-1)
torch.testing.assert_close(elementwise.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
built = sorted(p.name for p in kernels.cache_dir().iterdir())
print("ok", built)
"""


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_kernels_built_for_a_lesser_isa_compute_what_torch_does(isa, tmp_path):
    """``$PDSERVE_KERNEL_ISA=avx2`` builds the 8-lane AVX2 code on any x86-64 CPU that runs it (an AVX-512
    machine included; torch and oneDNN capped to AVX2 alike), ``generic`` a build with no AVX at all:
    the prompt attention, the few-row matmul, RMSNorm and SwiGLU agree with torch's. Each build lands in its own cache
    file (the flags are in its key)."""
    if os.uname().machine != "x86_64":
        pytest.skip("the ISA levels are x86-64's")
    env = {**os.environ, "PDSERVE_KERNEL_ISA": isa, "PDSERVE_KERNEL_CACHE": str(tmp_path),
           "ATEN_CPU_CAPABILITY": "avx2" if isa == "avx2" else "default", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "PDSERVE_DISABLE_TORCH_OPS": "1"}  # the C++ operators hold no vector code: no build per ISA
    proc = subprocess.run([sys.executable, "-c", _ISA_CHECK], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok") and "decode_linear-" in proc.stdout and "prefill_attention-" in proc.stdout


def test_an_unknown_isa_is_refused(monkeypatch):
    from pdserve import kernels

    monkeypatch.setenv("PDSERVE_KERNEL_ISA", "avx1024")
    with pytest.raises(ValueError, match="PDSERVE_KERNEL_ISA"):
        kernels.compiler_flags()


def test_kernel_signatures_are_read_from_their_c_definitions(tmp_path):
    """ctypes types each entry point from its C definition (``kernel_functions``), not from a list kept by
    hand beside it; a parameter type with no ctypes mapping is refused, not guessed."""
    import ctypes

    from pdserve.kernels import kernel_functions, load_elementwise

    functions = kernel_functions("elementwise.cpp")
    assert list(functions) == ["pdserve_silu_and_mul", "pdserve_rms_norm", "pdserve_rope_rotate_half"]
    rms = functions["pdserve_rms_norm"]
    assert [name for _, name in rms.params] == ["out", "x", "weight", "rows", "hidden", "x_row", "out_row", "eps",
                                                "num_threads"]
    assert rms.argtypes == [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int]
    odd = tmp_path / "odd.cpp"
    odd.write_text('extern "C" int pdserve_odd(const float* x,\n    size_t n) { return 0; }\n')
    with pytest.raises(KeyError, match="size_t"):
        kernel_functions(odd)
    lib = load_elementwise()
    if lib is not None:
        assert lib.pdserve_rms_norm.argtypes == rms.argtypes
