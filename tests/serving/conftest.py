"""The serving tests' markers.  Their ``served`` fixture (a local Ray, the Serve app on configs/tiny.yaml with
real gRPC and HTTP ports) lives in tests/conftest.py, shared with tests/loadtest: one cluster per session."""
from __future__ import annotations

import pytest

from tests.support.fake_coordinator import http_app


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: property-based requests through the served cluster's ports "
                            "(scale with SPECSERVE_FUZZ_EXAMPLES)")


@pytest.fixture
def app(tiny_engine):
    """The replica's HTTP app over the in-process tiny engine (no Ray), and its deployment stand-in."""
    return http_app(tiny_engine)
