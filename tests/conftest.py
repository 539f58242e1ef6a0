import os

# Ray reads this once, when it is first imported (by whichever test module comes first): a node's
# address is then 127.0.0.1, so a local Ray cluster in the tests never leaves loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Engines in tests run eagerly (each compiled start-up costs seconds): the compiled decode
# step has its own tests (tests/test_compiled_step.py), which turn compilation back on.
os.environ.setdefault("PDSERVE_ENFORCE_EAGER", "1")
# Engines that decode keep plain weights in tests (``--linear-weight-format auto`` would time both layouts
# at load and take the faster, which differs between machines): tests/test_packed_weights.py covers
# oneDNN's layout and the choice itself.
os.environ.setdefault("PDSERVE_LINEAR_WEIGHT_FORMAT", "plain")
# Engines in tests run every native kernel that builds (``--native-kernels all``), not the ones a timed
# probe at load prefers on this machine: which path a test takes must not depend on the CPU.
# tests/test_kernel_choice.py covers the probe and the torch paths themselves.
os.environ.setdefault("PDSERVE_NATIVE_KERNELS", "all")
# Probes measure at every start in tests (a choice kept by an earlier run must not steer a test):
# tests/test_measured_choices.py covers keeping them.
os.environ.setdefault("PDSERVE_MEASURED_CHOICES", "off")

import pytest  # noqa: E402

from pdserve.default_model.tiny_model import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The deterministic tiny checkpoint, written once per test session (tests only read it)."""
    return str(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny"))
