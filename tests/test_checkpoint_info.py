"""What a checkpoint says of itself, read without torch (pdserve.common.checkpoint): the router and the
model runner read EOS ids the same way."""

from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoConfig

from pdserve.common.checkpoint import checkpoint_dtype, read_eos_token_ids


def test_eos_ids_from_both_files_and_the_dtype(tmp_path, model_dir):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7], "torch_dtype": "bfloat16"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert read_eos_token_ids(str(tmp_path)) == {2, 7, 9}
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    # a runner passes the transformers config, whose value wins over config.json's text
    assert read_eos_token_ids(model_dir, AutoConfig.from_pretrained(model_dir)) == read_eos_token_ids(model_dir)
    (tmp_path / "generation_config.json").write_text("{broken")
    assert read_eos_token_ids(str(tmp_path)) == {2, 7}


def test_reading_a_checkpoint_imports_no_torch(model_dir):
    code = (f"import sys; from pdserve.common.checkpoint import read_eos_token_ids as r; r({model_dir!r}); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
