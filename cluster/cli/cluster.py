"""``specserve up`` / ``down`` / ``client`` / ``serve-config``: run the serving cluster and talk to it (see
docs/operator-guide.md)."""
from __future__ import annotations

import os
import sys
import time

from cluster.cli.common import load_built_config
from cluster.config.layout import ClusterSpec, check_host
from cluster.errors import ConfigError, ParamError, check_float, check_int
from cluster.serving.fronts.app import start_serve
from cluster.serving.ops.bind_hook import HOOK, hook_env
from cluster.serving.client.sdk import SpecServeClient, main_client
from cluster.serving.ops.attached import (STOP, clear_attached, find_attached, ignore_stop_signals, interrupt_on_stop,
                                          save_attached, shut_down, stop_attached, wait_until_stopped)
from cluster.serving.ops.ray_node import (gcs_up, head_state_file, load_head, save_head, start_node, token_file,
                                          use_token)
from protos.ray_private import check_startup


def add_cluster_commands(sub) -> None:
    u = sub.add_parser("up", help="start Ray (or join --address) and serve the config's cluster")
    u.add_argument("--config", default="configs/local.yaml", help="YAML config (default: configs/local.yaml)")
    u.add_argument("--address", help="join this Ray cluster (host:port of its GCS) instead of starting one; "
                   "needs its token (RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)")
    u.add_argument("--detach", action="store_true",
                   help="return once serving; the Ray head keeps running until `specserve down --stop-ray`")
    u.add_argument("--ray-port", dest="ray_port", default="6379",
                   help="GCS port of the Ray head started on 127.0.0.1 (default 6379; not with --address)")
    u.add_argument("--grpc-host", dest="grpc_host",
                   help="address the gRPC proxy listens on (default: cluster.grpc_host, 127.0.0.1)")
    u.add_argument("--tls-cert", dest="tls_cert", help="PEM certificate: serve gRPC over TLS only "
                   "(default: cluster.grpc_tls_cert)")
    u.add_argument("--tls-key", dest="tls_key", help="PEM private key for --tls-cert")
    u.add_argument("--timeout", default="900", help="seconds to wait for SERVING (default 900)")

    s = sub.add_parser("serve-config", help="print the Ray Serve config that deploys a config (for serve deploy "
                       "or a KubeRay RayService's serveConfigV2); `up` deploys the same")
    s.add_argument("--config", default="configs/local.yaml", help="YAML config (default: configs/local.yaml)")
    s.add_argument("--path", help="the config's path where Serve runs (default: --config), e.g. /app/configs/x.yaml")

    d = sub.add_parser("down", help="stop an attached `specserve up`, or delete the served application (and "
                       "optionally stop the local Ray)")
    d.add_argument("--address", help="Ray cluster address (default: the attached `specserve up`'s, which then "
                   "stops itself; else the head `up --detach` started)")
    d.add_argument("--app", help="application name (cluster.app_name; default: the attached `up`'s, else specserve)")
    d.add_argument("--stop-ray", action="store_true",
                   help="also stop the Ray head `specserve up --detach` started (only that one)")

    c = sub.add_parser("client", help="send one request to a running cluster over gRPC")
    c.add_argument("--address", default="127.0.0.1:9000", help="gRPC host:port (default 127.0.0.1:9000)")
    c.add_argument("--app", default="specserve", help="application name sent as gRPC metadata")
    c.add_argument("--prompt", default="", help="prompt text")
    c.add_argument("--chat", help="a user message, rendered with the served model's chat template "
                   "(instead of --prompt)")
    c.add_argument("--logprobs", help="return the target's logprob of each token and its top N (0..20)")
    c.add_argument("--strategy", help="decoding strategy (default: the server's)")
    c.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="strategy option, e.g. --option k=4 (repeatable)")
    c.add_argument("--max-new-tokens", dest="max_new_tokens")
    c.add_argument("--temperature")
    c.add_argument("--top-p", dest="top_p")
    c.add_argument("--top-k", dest="top_k")
    c.add_argument("--seed")
    c.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    c.add_argument("--stream", action="store_true", help="print chunks as they arrive")
    c.add_argument("--json", action="store_true", help="print the full response as JSON")
    c.add_argument("--info", action="store_true", help="print ServerInfo and exit")
    c.add_argument("--health", action="store_true", help="print the gRPC health status and exit")
    c.add_argument("--timeout", help="per-call deadline in seconds")
    c.add_argument("--tls", action="store_true", help="connect over TLS (a server started with --tls-cert)")
    c.add_argument("--ca", help="PEM file of the CA (or self-signed) certificate to trust (with --tls; "
                   "default: the system's roots)")


def run_cluster_command(args) -> int:
    if args.command == "up":
        return cmd_up(args)
    if args.command == "down":
        return cmd_down(args)
    for kv in args.option:
        if "=" not in kv:
            raise ParamError("option", "NAME=VALUE", kv)
    return main_client(args)


def _grpc_listen(args, cl) -> tuple[str, str | None, str | None]:
    """Where the gRPC proxy listens and its TLS files: flags over the config, checked before Ray starts."""
    host = cl.grpc_host
    if args.grpc_host:
        try:
            host = check_host("grpc_host", args.grpc_host)
        except ConfigError:
            raise ParamError("grpc_host", "an IP address of this machine, e.g. 127.0.0.1 or 0.0.0.0",
                             args.grpc_host) from None
    cert, key = args.tls_cert or cl.grpc_tls_cert, args.tls_key or cl.grpc_tls_key
    if (cert is None) != (key is None):
        raise ParamError("tls_key" if key is None else "tls_cert", "a PEM file, given with the other", None)
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name}: no such file {path!r}")
    return host, cert, key


ATTACHED_STOP_S = 120.0       # bounds `down` waiting for an attached `up`'s shutdown (each of its steps is bounded)


def cmd_up(args) -> int:
    cfg = load_built_config(args.config)
    timeout = check_float("timeout", args.timeout, 1, 86400)
    cl = cfg.cluster
    host, cert, key = _grpc_listen(args, cl)
    check_startup(needs_binding=True)          # the gRPC host / TLS binding patches Ray internals
    interrupt_on_stop()                        # `specserve down` and Ctrl-C stop `up` the same way
    address, node = args.address, None
    if not address:
        node = start_node(port=check_int("ray_port", args.ray_port, 1024, 65535),
                          log_path=token_file().parent / "specserve-head.log")
        address = node.address
        print(f"specserve: Ray head on {address} (pid {node.pid}; loopback only, token auth: {token_file()})",
              file=sys.stderr)
    use_token(address)
    import ray
    me = None
    try:
        ray.init(address=address, namespace="specserve", include_dashboard=False,
                 runtime_env={"worker_process_setup_hook": HOOK, "env_vars": hook_env(host, cert, key)})
        interrupt_on_stop()                    # ray.init replaced SIGTERM's with its own (sys.exit)
        if not args.detach:                    # from here on `specserve down` asks this process to stop
            me = save_attached(ray.get_runtime_context().gcs_address, cl.app_name, node)
        _deploy(cfg, address, host, cert, timeout)
        for url in metrics_urls():
            print(f"specserve: Prometheus metrics  {url}", file=sys.stderr)
        if args.detach:
            if node is not None:
                save_head(node)
            print("specserve: detached; stop with `specserve down" + (" --stop-ray`" if node else "`"),
                  file=sys.stderr)
            return 0
        print("specserve: Ctrl-C (or `specserve down`) to stop", file=sys.stderr)
        why, serve_running = wait_until_stopped(cl.app_name, own_head=node is not None)
    except BaseException:                      # Ctrl-C or `specserve down` before SERVING, or a failure
        ignore_stop_signals()
        if not STOP.is_set():                  # not a stop: Serve may be unreachable; stop the driver and head
            shut_down(node, serve_running=False)
            clear_attached(me)
            raise
        why, serve_running = "interrupted", ray.is_initialized()
    print(f"specserve: stopping ({STOP_REASONS[why]}) ...", file=sys.stderr)
    shut_down(node, serve_running=serve_running)
    clear_attached(me)
    print("specserve: stopped" + (f", Ray head (pid {node.pid}) included" if node else ""), file=sys.stderr)
    return 0


STOP_REASONS = {"interrupted": "Ctrl-C or `specserve down`", "deleted": "another driver deleted the application",
                "serve-gone": "another driver shut Serve down"}


def _deploy(cfg, address: str, host: str, cert: str | None, timeout: float) -> None:
    cl = cfg.cluster
    topology, why = cl.placement()
    print(f"specserve: deploying {cfg.source} (topology {topology}: {why}, tp_size {cl.tp_size}, "
          f"replicas {cl.replicas}) ...", file=sys.stderr)
    start_serve(cfg, address=address)
    with SpecServeClient(f"{_dial(host)}:{cl.grpc_port}", app=cl.app_name, **_tls(cert)) as c:
        c.wait_ready(timeout)
    grpc_mode = "TLS" if cert else "plaintext" + (" (loopback only)" if host == "127.0.0.1" else
                                                   ": no certificate configured, the bearer key travels in clear")
    print(f"specserve: SERVING  gRPC {host}:{cl.grpc_port} {grpc_mode} (specserve.v1.SpecServe)  "
          f"HTTP http://{cl.http_host}:{cl.http_port}/v1/completions", file=sys.stderr)


def _dial(host: str) -> str:
    """The address to reach a listener on ``host`` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)


def _tls(cert: str | None) -> dict:
    """``SpecServeClient``'s TLS arguments for a proxy serving ``cert`` (it is its own CA when self-signed)."""
    return {"tls": True, "ca": cert} if cert else {}


def metrics_urls() -> list[str]:
    """Each live Ray node's metrics endpoint (Ray exports Serve's and ours there; docs/operator-guide.md, "Metrics")."""
    import ray
    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


def cmd_down(args) -> int:
    head = load_head()
    up = find_attached(args.address)
    if up is not None and args.app not in (None, up.app):
        raise ParamError("app", f"the application of the attached `specserve up` ({up.app})", args.app)
    if up is not None:
        # An attached `up` owns every shutdown step (cluster/serving/ops/attached.py): ask it, wait for it
        print(f"specserve: asking `specserve up` (pid {up.pid}) to stop {up.app} ...", file=sys.stderr)
        start = time.monotonic()
        if not stop_attached(up, ATTACHED_STOP_S):
            print(f"specserve: `specserve up` (pid {up.pid}) still running {ATTACHED_STOP_S:.0f}s after it was asked "
                  "to stop; see its output", file=sys.stderr)
            return 1
        print(f"specserve: {up.app} stopped by its `specserve up` (pid {up.pid})"
              + (f" with its Ray head (pid {up.head_pid})" if up.head_pid else "")
              + f" in {time.monotonic() - start:.1f}s", file=sys.stderr)
    else:
        address = args.address or (head.address if head else "auto")
        if address != "auto" and not gcs_up(address):       # ray.init would retry a closed port for minutes
            print(f"specserve: no Ray cluster at {address} (nothing listens there)", file=sys.stderr)
            return 1
        use_token(address)
        import ray
        from ray import serve
        try:
            ray.init(address=address, namespace="specserve", include_dashboard=False)
        except ConnectionError as e:
            print(f"specserve: no Ray cluster at {address}: {e}", file=sys.stderr)
            return 1
        app = args.app or ClusterSpec.app_name
        serve.delete(app)
        serve.shutdown()
        ray.shutdown()
        print(f"specserve: {app} stopped", file=sys.stderr)
    if args.stop_ray and not (up is not None and up.head_pid):        # an attached up stopped its own head
        if head is None:
            print("specserve: no Ray head started by `specserve up --detach` is running", file=sys.stderr)
        else:
            head.stop()
            head_state_file().unlink(missing_ok=True)
            print(f"specserve: Ray head {head.address} (pid {head.pid}) stopped", file=sys.stderr)
    return 0
