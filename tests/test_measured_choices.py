"""Start-up measurements kept across restarts (pdserve.engine.execution.measured_choices): the first start
measures and keeps, a restart takes what was kept (the same plan, so the same compiled graphs), a bad
file is measured over, and another model or machine setting is another file."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve import LLM
from pdserve.engine.layers.native_switch import native


@pytest.fixture
def kept_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_MEASURED_CHOICES", str(tmp_path / "measured"))
    return tmp_path / "measured"


def start(model_dir, **kw):
    llm = LLM(model_dir, native_kernels="auto", linear_weight_format="auto", kv_cache_memory="1MiB", **kw)
    runner = llm.core.runner
    plan = runner.plan.as_dict()
    choices = {k: c.path for k, c in runner.kernel_choices.items()}
    llm.close()
    return plan, choices


def test_a_restart_takes_the_choices_the_first_start_measured(model_dir, kept_dir):
    plan, choices = start(model_dir)
    assert "earlier start" not in plan["native_kernels"] and "earlier start" not in plan["linear_weight_format"]
    files = list(kept_dir.glob("*.json"))
    assert len(files) == 1
    kept = json.loads(files[0].read_text())
    assert {k: c["path"] for k, c in kept["kernels"].items()} == choices
    assert kept["linear_weight_format"][0] == plan["linear_weight_format"].split()[0]

    # what is kept is what a restart runs: flip every kernel's path and the layout in the file
    flipped = {k: "torch" if p == "native" else "native" for k, p in choices.items()}
    for name, path in flipped.items():
        kept["kernels"][name]["path"] = path
    other = "onednn" if kept["linear_weight_format"][0] == "plain" else "plain"
    kept["linear_weight_format"] = [other, "timed: edited by the test"]
    files[0].write_text(json.dumps(kept))
    plan2, choices2 = start(model_dir)
    assert choices2 == flipped and "earlier start" in plan2["native_kernels"]
    assert plan2["linear_weight_format"].startswith(f"{other} (timed: edited by the test; measured at an earlier")
    assert all(native(k) == (p == "native") for k, p in flipped.items())

    files[0].write_text("{not json")  # a bad file is measured over, and rewritten
    plan3, _ = start(model_dir)
    assert "earlier start" not in plan3["native_kernels"]
    assert json.loads(files[0].read_text())["version"] == 1


def test_another_model_or_setting_is_measured_apart(model_dir, kept_dir, tmp_path):
    start(model_dir)
    start(model_dir, max_model_len=64)  # the attention probe's lengths change
    other = shutil.copytree(model_dir, tmp_path / "copy")
    start(str(other))
    assert len(list(kept_dir.glob("*.json"))) == 3


def test_off_keeps_nothing(model_dir, kept_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_MEASURED_CHOICES", "off")
    start(model_dir)
    assert not kept_dir.exists()
