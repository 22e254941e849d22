"""gRPC server reflection through Serve's gRPC proxy (what grpcurl and Postman use to list and call the services
without the proto file): against the served test cluster, the services are listed, SpecServe's methods and message
fields are described from the server alone, and a request built from those descriptors alone is answered."""
from __future__ import annotations

import importlib.metadata

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster.serving.ops.deploy import serve_config


def test_reflection_is_enabled_in_every_deploy_description():
    from cluster.config.schema import load_config
    assert serve_config(load_config("configs/tiny.yaml"), "configs/tiny.yaml")["grpc_options"]["enable_reflection"]
    # the reflection service answers from the proxy's grpcio: one pinned version for both
    assert importlib.metadata.version("grpcio-reflection") == importlib.metadata.version("grpcio")


@pytest.mark.timeout(300)
def test_services_listed_and_called_through_reflection(served):
    cfg, c = served
    with grpc.insecure_channel(f"127.0.0.1:{cfg.cluster.grpc_port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"specserve.v1.SpecServe", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} \
            <= services, services
        assert not any(s.startswith("ray.serve") for s in services)         # Serve's own API is not advertised
        pool = descriptor_pool.DescriptorPool(db)
        svc = pool.FindServiceByName("specserve.v1.SpecServe")
        assert {m.name for m in svc.methods} == {"Generate", "GenerateStream", "ServerInfo"}
        req_type = pool.FindMessageTypeByName("specserve.v1.GenerateRequest")
        assert {"prompt", "messages", "prediction", "chat_template_kwargs"} <= set(req_type.fields_by_name)
        # a client that has only the descriptors (as grpcurl) builds, sends and reads a request
        Request = message_factory.GetMessageClass(req_type)
        Response = message_factory.GetMessageClass(pool.FindMessageTypeByName("specserve.v1.GenerateResponse"))
        call = channel.unary_unary("/specserve.v1.SpecServe/Generate", request_serializer=Request.SerializeToString,
                                   response_deserializer=Response.FromString)
        out = call(Request(prompt="def f():", max_new_tokens=3, temperature=0.0), metadata=c.metadata, timeout=120)
        assert len(out.token_ids) == 3 and out.finish_reason == "length"
