import pytest

from pdserve.models.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The deterministic tiny checkpoint, written once per test session (tests only read it)."""
    return str(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny"))
