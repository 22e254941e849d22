"""``specserve up`` / ``down`` / ``client`` / ``serve-config``: run the serving cluster and talk to it (see
docs/cluster.md)."""
from __future__ import annotations

import subprocess
import sys
import time

import yaml

from cluster.cli.common import load_built_config
from cluster.config.schema import load_config
from cluster.errors import ParamError, check_float
from cluster.serving.app import start_serve
from cluster.serving.client import SpecServeClient, main_client
from cluster.serving.deploy import serve_config


def add_cluster_commands(sub) -> None:
    u = sub.add_parser("up", help="start Ray (or join --address) and serve the config's cluster")
    u.add_argument("--config", default="configs/local.yaml", help="YAML config (default: configs/local.yaml)")
    u.add_argument("--address", help="join this Ray cluster (e.g. auto, ray://host:10001) instead of starting one")
    u.add_argument("--detach", action="store_true",
                   help="return once serving (starts a Ray head with `ray start --head` unless --address)")
    u.add_argument("--timeout", default="900", help="seconds to wait for SERVING (default 900)")

    s = sub.add_parser("serve-config", help="print the Ray Serve config that deploys a config (for serve deploy "
                       "or a KubeRay RayService's serveConfigV2); `up` deploys the same")
    s.add_argument("--config", default="configs/local.yaml", help="YAML config (default: configs/local.yaml)")
    s.add_argument("--path", help="the config's path where Serve runs (default: --config), e.g. /app/configs/x.yaml")

    d = sub.add_parser("down", help="delete the served application (and optionally stop the local Ray)")
    d.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    d.add_argument("--app", default="specserve", help="application name (cluster.app_name)")
    d.add_argument("--stop-ray", action="store_true", help="also run `ray stop` on this machine")

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


def run_cluster_command(args) -> int:
    if args.command == "up":
        return cmd_up(args)
    if args.command == "down":
        return cmd_down(args)
    if args.command == "serve-config":
        cfg = load_config(args.config)
        print(yaml.safe_dump(serve_config(cfg, args.path or args.config), sort_keys=False), end="")
        return 0
    for kv in args.option:
        if "=" not in kv:
            raise ParamError("option", "NAME=VALUE", kv)
    return main_client(args)


def cmd_up(args) -> int:
    cfg = load_built_config(args.config)
    timeout = check_float("timeout", args.timeout, 1, 86400)
    address = args.address
    if args.detach and not address:
        subprocess.run(["ray", "start", "--head", "--disable-usage-stats", "--include-dashboard=false"],
                       check=True)
        address = "auto"
    cl = cfg.cluster
    print(f"specserve: deploying {cfg.source} (topology {cl.topology}, tp_size {cl.tp_size}, "
          f"replicas {cl.replicas}) ...", file=sys.stderr)
    start_serve(cfg, address=address)
    with SpecServeClient(f"127.0.0.1:{cl.grpc_port}", app=cl.app_name) as c:
        c.wait_ready(timeout)
    print(f"specserve: SERVING  gRPC 127.0.0.1:{cl.grpc_port} (specserve.v1.SpecServe)  "
          f"HTTP http://{cl.http_host}:{cl.http_port}/v1/completions", file=sys.stderr)
    for url in metrics_urls():
        print(f"specserve: Prometheus metrics  {url}", file=sys.stderr)
    if args.detach:
        print("specserve: detached; stop with `specserve down" + (" --stop-ray`" if not args.address else "`"),
              file=sys.stderr)
        return 0
    print("specserve: Ctrl-C (or `specserve down`) to stop", file=sys.stderr)
    from ray import serve
    try:
        while cl.app_name in serve.status().applications:     # returns after `specserve down`
            time.sleep(2)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def metrics_urls() -> list[str]:
    """Each live Ray node's metrics endpoint (Ray exports Serve's and ours there; docs/cluster.md)."""
    import ray
    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


def cmd_down(args) -> int:
    import ray
    from ray import serve
    try:
        ray.init(address=args.address, namespace="specserve", include_dashboard=False)
    except ConnectionError as e:
        print(f"specserve: no Ray cluster at {args.address}: {e}", file=sys.stderr)
        return 1
    serve.delete(args.app)
    serve.shutdown()
    ray.shutdown()
    if args.stop_ray:
        subprocess.run(["ray", "stop"], check=False)
    print(f"specserve: {args.app} stopped", file=sys.stderr)
    return 0
