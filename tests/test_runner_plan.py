"""A model runner's start-up choices as data (``pdserve.engine.execution.runner_plan``): each decision with
its reason, in a fixed order; the choice functions on their own. /workers showing a live worker's plan is
tested in tests/test_cluster.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.execution.runner_plan import (DECISIONS, RunnerPlan, decide_decode_step,
                                                  decide_linear_weight_format)

CPU = torch.device("cpu")


def test_a_plan_keeps_each_decision_with_its_reason_in_decision_order():
    plan = RunnerPlan()
    plan.decide("decode_step", "eager", "--enforce-eager")
    plan.decide("dtype", "float32", "auto: the checkpoint's float32")
    plan.decide("quantization", "none")
    assert list(plan.as_dict()) == ["dtype", "quantization", "decode_step"]  # DECISIONS' order, not the calls'
    assert plan.as_dict()["dtype"] == "float32 (auto: the checkpoint's float32)"
    assert plan.as_dict()["quantization"] == "none" and plan["decode_step"] == "eager"
    assert plan.describe().splitlines()[0] == "  dtype: float32 (auto: the checkpoint's float32)"
    with pytest.raises(KeyError, match="not a runner decision"):
        plan.decide("dtpye", "float32")
    assert set(DECISIONS) >= set(plan.values)


@pytest.mark.parametrize("args,compiled,why", [
    (dict(), True, ""),
    (dict(enforce_eager=True), False, "--enforce-eager"),
    (dict(batch_invariant=True), False, "--batch-invariant"),
    (dict(quantization="int8", dtype=torch.bfloat16), False, "--quantization int8 without the int8 kernel"),
    (dict(quantization="int8", int8_kernel_built=False), False, "--quantization int8 without the int8 kernel"),
    (dict(quantization="int8", int8_kernel_built=True), True, ""),
    (dict(quantization="int8", enforce_eager=True, dtype=torch.bfloat16), False, "--quantization int8"),
    (dict(single_rank=False), False, "several ranks"),
    (dict(attention_backend="reference"), False, "the reference attention backend"),
])
def test_the_decode_step_is_compiled_unless_a_reason_says_otherwise(args, compiled, why):
    full = dict(enforce_eager=False, batch_invariant=False, quantization=None, dtype=torch.float32,
                int8_kernel_built=False) | args
    got, reason = decide_decode_step(**full)
    assert got == compiled and reason.startswith(why)


@pytest.mark.parametrize("requested,device,single_rank,batch_invariant,quantization,want", [
    ("onednn", CPU, True, False, None, ("onednn", "--linear-weight-format")),
    ("auto", torch.device("meta"), True, False, None, ("plain", "not a CPU")),
    ("auto", CPU, False, False, None, ("plain", "several ranks would each choose")),
    ("auto", CPU, True, True, None, ("plain", "--batch-invariant")),
    ("auto", CPU, True, False, "int8", ("plain", "--quantization int8")),
    ("panel", CPU, True, False, None, ("panel", "--linear-weight-format")),
])
def test_the_weight_layout_is_timed_only_where_it_can_pay(requested, device, single_rank, batch_invariant,
                                                          quantization, want):
    assert decide_linear_weight_format(requested, device, single_rank, batch_invariant, quantization,
                                       model=None) == want


def test_workers_compile_the_decode_step_in_the_background_and_llm_before_it_serves(model_dir):
    """A worker serves within seconds (its steps run eagerly while the compiled step builds); the offline
    LLM compiles first, as vLLM's does. Both round-trip through the ranks' command line."""
    import argparse

    from pdserve.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    worker = EngineConfig.from_cli_args(parser.parse_args(["--model", model_dir]), role="decode")
    assert worker.decode_step_compile == "background"
    assert EngineConfig(model=model_dir).decode_step_compile == "startup"
    startup = EngineConfig.from_cli_args(parser.parse_args(["--model", model_dir, "--decode-step-compile", "startup"]))
    assert startup.decode_step_compile == "startup"
    ranks = parser.parse_args(startup.rank_cli_args(1, "127.0.0.1", 29500))
    assert ranks.decode_step_compile == "startup"
    with pytest.raises(ValueError, match="decode_step_compile"):
        EngineConfig(model=model_dir, decode_step_compile="later")
