"""The CPU allocator setting every model process makes (pdserve.common.utils.keep_freed_memory)."""

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, resource, torch
from pdserve.common.utils import keep_freed_memory
tuned = keep_freed_memory()


def prefill(n):  # a float32 prefill's activations, layer by layer (hidden 768, MLP 2 x 2048, 12 heads' scores)
    for _ in range(12):
        x = torch.ones(n, 768)
        gate_up = torch.ones(n, 4096).mul_(x.sum())
        scores = torch.ones(12, n, n)
        del x, gate_up, scores


lengths = (288, 450, 288, 512, 300, 100)  # prompts of a few hundred tokens
for n in lengths:  # warm: every size has been seen once
    prefill(n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for n in lengths:
    prefill(n)
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _probe(keep: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={"PDSERVE_KEEP_FREED_MEMORY": keep, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_are_reused_without_page_faults():
    default = _probe("0")
    tuned = _probe("1")
    assert not default["tuned"] and tuned["tuned"]
    # glibc's defaults hand freed pages back to the kernel, so prompts of sizes already seen fault
    # their activations in again (4 KiB a fault); kept, freed pages are reused
    assert default["faults"] > 2000
    assert tuned["faults"] * 10 < default["faults"]
