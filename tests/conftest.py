import pytest
import torch

from cluster.config.schema import load_config
from tests.support.built import engine_for

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_engine():
    """The in-process engine over configs/tiny.yaml (random tiny target and two truncated drafters)."""
    cfg = load_config("configs/tiny.yaml")
    return engine_for(cfg)
