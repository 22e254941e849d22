"""The serving tests' markers.  Their ``served`` fixture (a local Ray, the Serve app on configs/tiny.yaml with
real gRPC and HTTP ports) lives in tests/conftest.py, shared with tests/loadtest: one cluster per session."""
from __future__ import annotations

import pytest

from tests.support.built import engine_for
from tests.support.fake_coordinator import http_app


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: property-based requests through the served cluster's ports "
                            "(scale with SPECSERVE_FUZZ_EXAMPLES)")


@pytest.fixture
def app(tiny_engine):
    """The replica's HTTP app over the in-process tiny engine (no Ray), and its deployment stand-in."""
    return http_app(tiny_engine)


@pytest.fixture(scope="module")
def sdk(served):
    """(config, the official ``openai`` SDK's client) against the served cluster's HTTP port."""
    openai = pytest.importorskip("openai")
    cfg, _ = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.cluster.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=300)
    yield cfg, client
    client.close()


@pytest.fixture(scope="module")
def served_engine(served):
    """The in-process engine of the served cluster's config (its Max-Gram drafter included), to compare with."""
    return engine_for(served[0])
