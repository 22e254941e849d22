"""``specserve serve-config``: the Ray Serve config of a specserve config, printed, or written into a KubeRay
RayService manifest with the config inline (k8s/; docs/operator-guide.md, "Kubernetes (KubeRay)").

Why inline rather than a mounted ConfigMap: KubeRay compares ``serveConfigV2`` and re-applies it in place
under every upgrade strategy, so an edit of the manifest redeploys the application with the new config (Serve
replaces the replicas, draining them), with no image build and no pod restart.  A mounted ConfigMap changes a
file under running replicas that Serve never re-reads (the kubelet updates the mount, nothing redeploys), so
new and old replicas would serve different configs until someone restarts them.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from cluster.config.schema import config_from_dict
from cluster.errors import ConfigError
from cluster.serving.ops.deploy import serve_config

_BLOCK = re.compile(r"^(?P<indent> *)serveConfigV2: \|[^\n]*\n(?P<body>(?:(?P=indent)  [^\n]*\n|[ \t]*\n)*)", re.M)


def add_serve_config_options(parser) -> None:
    """Options beyond ``--config`` / ``--path`` (declared with the cluster commands)."""
    parser.add_argument("--inline", action="store_true",
                        help="carry the config itself in the application's args (what k8s/ manifests do)")
    parser.add_argument("--rayservice", metavar="MANIFEST",
                        help="write it (inline) as serveConfigV2 of this RayService manifest, in place")


def serve_config_text(config: str, path: str | None = None, inline: bool = False) -> str:
    """The Serve config YAML for the specserve config file ``config`` (validated first)."""
    p = Path(config)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    data = yaml.safe_load(p.read_text())
    cfg = config_from_dict(data, source=str(p))
    return yaml.safe_dump(serve_config(cfg, path or config, inline=data if inline else None), sort_keys=False)


def write_rayservice(manifest: str, text: str) -> None:
    """Replace the literal ``serveConfigV2: |`` block of the one RayService in ``manifest`` by ``text``; every
    other line (comments included) stays as it is."""
    p = Path(manifest)
    source = p.read_text()
    blocks = list(_BLOCK.finditer(source))
    if len(blocks) != 1:
        raise ConfigError(f"{p}: expected one `serveConfigV2: |` block, found {len(blocks)}")
    m = blocks[0]
    pad = m.group("indent") + "  "
    body = "".join(pad + line + "\n" if line else "\n" for line in text.splitlines())
    p.write_text(source[:m.start("body")] + body + source[m.end("body"):])


def cmd_serve_config(args) -> int:
    text = serve_config_text(args.config, args.path, inline=args.inline or bool(args.rayservice))
    if args.rayservice:
        write_rayservice(args.rayservice, text)
    else:
        print(text, end="")
    return 0
