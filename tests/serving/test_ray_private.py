"""protos/ray_private.py: the private Ray Serve patches apply only on the Ray they were written for; on another,
`specserve up` is refused with a clear error and a plain Serve deployment runs without them."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from protos.ray_private import WRITTEN_FOR, RayVersionError, check_startup, patches_apply, wrap_handler_factory


def test_the_pinned_ray_is_the_one_the_patches_were_written_for():
    import ray
    assert ray.__version__ == WRITTEN_FOR and patches_apply()
    assert check_startup(needs_binding=True) is True


def test_another_ray_refuses_the_binding_naming_both_versions():
    with pytest.raises(RayVersionError) as e:
        check_startup(needs_binding=True, version="9.9.9")
    assert "9.9.9" in str(e.value) and WRITTEN_FOR in str(e.value) and "TLS" in str(e.value)


def test_another_ray_runs_plain_serve_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="specserve.ray_private"):
        assert check_startup(needs_binding=False, version="9.9.9") is False
    assert len(caplog.records) == 1 and "plain Ray Serve" in caplog.text


def test_the_proxy_handler_factory_is_wrapped_once_and_only_on_the_pinned_ray():
    def factory(**kw):
        return kw

    def wrap(f):
        def wrapped(**kw):
            return ("wrapped", f(**kw))
        wrapped.marked = True
        return wrapped

    server = SimpleNamespace(service_handler_factory=factory)
    assert not wrap_handler_factory(server, wrap, "marked", version="9.9.9")
    assert server.service_handler_factory is factory                     # plain Serve: left alone
    assert wrap_handler_factory(server, wrap, "marked", version=WRITTEN_FOR)
    assert server.service_handler_factory(a=1) == ("wrapped", {"a": 1})
    assert not wrap_handler_factory(server, wrap, "marked", version=WRITTEN_FOR)    # already wrapped
    assert not wrap_handler_factory(SimpleNamespace(), wrap, "marked", version=WRITTEN_FOR)   # not Serve's
