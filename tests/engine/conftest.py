import pytest
from engine_helpers import tiny_hf


@pytest.fixture
def make_hf():
    return tiny_hf
