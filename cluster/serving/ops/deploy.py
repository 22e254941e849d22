"""The one deploy description: how a config becomes Ray Serve options, for ``specserve up`` and for KubeRay.

:func:`serve_config` is the Serve config (``serve run`` / ``serve deploy`` / a RayService's ``serveConfigV2``)
of a specserve config file: proxies, ports, the guarded gRPC servicer functions and one application built by
``cluster.serving.fronts.app:app_builder`` from that file.  :func:`deployment_options` are the deployment's options
(units as replicas, fixed or autoscaled, drain time, resources), which the application builder applies from
the same file, so nothing about a unit is written twice.  ``specserve up`` starts Serve from
:func:`serve_config` too; ``specserve serve-config --inline`` prints it with the config inline and
``--rayservice`` writes that into a RayService manifest (tests hold k8s/ equal to it).
"""
from __future__ import annotations

from cluster.config.schema import Config
from protos.guard import GUARDED_SERVICER_FUNCTIONS

APP_BUILDER = "cluster.serving.fronts.app:app_builder"
DEPLOYMENT = "SpecServe"


def deployment_options(cfg: Config) -> dict:
    """``serve.deployment(...).options(**this)``: one replica = one serving unit."""
    cl = cfg.cluster
    opts = dict(ray_actor_options=cl.coordinator.ray_options(),     # placement: resources, label_selector
                max_ongoing_requests=cfg.engine.capacity + 32,   # headroom beyond admission for ServerInfo / health
                health_check_period_s=10, health_check_timeout_s=60,
                graceful_shutdown_timeout_s=cl.drain_timeout_s,   # a removed unit finishes its requests first
                graceful_shutdown_wait_loop_s=1)
    if cl.autoscaling is not None:
        opts["autoscaling_config"] = cl.autoscaling.serve_config(cfg.engine.max_batch)
    else:
        opts["num_replicas"] = cl.replicas
    return opts


def serve_config(cfg: Config, config_path: str, *, proxy_location: str | None = None,
                 inline: dict | None = None) -> dict:
    """The Serve config deploying ``cfg``: read from ``config_path`` where Serve runs, or, with ``inline`` (the
    config file's mapping), carried in the application's args (``source``: ``config_path``), as k8s/ does."""
    cl = cfg.cluster
    args = {"config": config_path} if inline is None else {"source": config_path, "config": inline}
    return {"proxy_location": proxy_location or cl.proxy_location,
            "http_options": {"host": cl.http_host, "port": cl.http_port},
            # enable_reflection: the proxy answers gRPC server reflection itself (grpcurl and Postman list and call
            # the services without the proto file; docs/operator-guide.md); Ray's default, written out so it is seen
            "grpc_options": {"port": cl.grpc_port, "grpc_servicer_functions": list(GUARDED_SERVICER_FUNCTIONS),
                             "enable_reflection": True},
            "applications": [{"name": cl.app_name, "route_prefix": "/", "import_path": APP_BUILDER,
                              "args": args}]}
