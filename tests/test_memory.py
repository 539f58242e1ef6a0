"""The CPU allocator setting every model process makes (pdserve.common.utils.keep_freed_memory)."""

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, resource, torch
from pdserve.common.utils import keep_freed_memory
tuned = keep_freed_memory()


def prefill(n):  # one float32 prefill's activations, layer by layer: live together, each under 32 MiB
    for _ in range(12):
        x = torch.ones(n, 768)
        gate_up = torch.ones(n, 4096)
        act = torch.ones(n, 2048)
        scores = torch.ones(4, n, n)
        gate_up.mul_(x.sum() + act.sum() + scores.sum())
        del x, gate_up, act, scores


lengths = (1024, 700, 1024, 900, 512, 1000)
for n in lengths:
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
    # glibc's defaults: freeing a mmapped chunk raises the mmap threshold to its size and the trim
    # threshold to twice that, so a layer whose live activations add up to more than twice its largest
    # tensor leaves a free heap top above the trim threshold, which goes back to the kernel; the next
    # layer faults it in again (4 KiB a fault; 28,000-500,000 seen, by heap layout). Tuned, the heap
    # is never trimmed and the pages are reused.
    assert default["faults"] > 20_000
    assert tuned["faults"] * 5 < default["faults"]
