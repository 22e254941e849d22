import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_engine():
    """The in-process engine over configs/tiny.yaml (random tiny target and two truncated drafters)."""
    from cluster.config import load_config
    from cluster.loader import build_engine
    return build_engine(load_config("configs/tiny.yaml"))
