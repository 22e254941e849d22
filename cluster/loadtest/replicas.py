"""Where the timeline's replica count comes from: any callable returning an int (sampled by the parent
process, never the locust worker).  :func:`serve_replicas` counts the RUNNING replicas of a Serve
application through ``ray.serve.status()``; the caller must be connected to that Ray cluster
(:func:`connect_ray`, or a process that already runs Ray, like a test with the cluster fixture)."""
from __future__ import annotations

from typing import Callable


def serve_replicas(app: str = "specserve", deployment: str | None = None) -> Callable[[], int]:
    """A callable: RUNNING replicas of ``app`` (of one ``deployment``, or all of the app's); 0 while the
    application is not deployed."""

    def count() -> int:
        from ray import serve
        status = serve.status().applications.get(app)
        if status is None:
            return 0
        deps = status.deployments.values() if deployment is None else [status.deployments[deployment]]
        return sum(int(d.replica_states.get("RUNNING", 0)) for d in deps)

    return count


def connect_ray(address: str) -> None:
    """Join the Ray cluster at ``address`` (e.g. ``auto``) as a driver, to read Serve's status."""
    import ray
    if not ray.is_initialized():
        ray.init(address=address, namespace="specserve-loadtest", include_dashboard=False, log_to_driver=False)
