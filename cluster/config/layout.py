"""The ``cluster:`` section of a config: how one serving unit is laid out on Ray, and its limits.

A serving unit = a coordinator (the Serve replica running :class:`cluster.engine.Engine`), its
drafters and its target group.  Serve replicas scale whole units (``replicas``, or ``autoscaling``).

Topologies (where the drafters run):
  * ``auto`` (default) -- chosen from the hardware by :meth:`ClusterSpec.placement`: ``separated`` where the draft
    side has a whole device of its own (``drafters.num_gpus >= 1``), ``speculator`` where it would share CPU
    cores or the target's device.
  * ``separated`` -- every drafter and the Max-Gram drafter in one draft-group actor behind the draft
    side: one round trip per step for the whole draft block.
  * ``colocated`` -- the drafters inside the coordinator process (small models: no call per draft).
  * ``speculator`` -- near drafter, far speculator: the drafters inside the coordinator answer misses, and the
    draft-group actor (its own copy of them) drafts the next blocks of the likely outcomes of each verification
    into a speculation cache (:mod:`cluster.core.draft.near_far`).
The target (``target_placement``) runs in the coordinator's process by default, or as an actor, or as a
tensor-parallel group of ``tp_size`` rank actors.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from cluster.errors import ConfigError, check_config_choice

# from the hardware (ClusterSpec.placement); drafters in their own actor, or inside the coordinator
TOPOLOGIES = ("auto", "separated", "colocated", "speculator")
# Where a single-rank target runs: in the coordinator's process, so the step loop and verification sit where the
# target's logits are and only drafts cross processes (the fewest bytes: no [L+1, V] logits per request and
# step), or in an actor of its own (isolates it; costs a round trip per step).  A TP target is always actors.
TARGET_PLACEMENTS = ("coordinator", "actor")
# How the coordinator's per-step draft call reaches the draft-group actor (separated): a Ray actor call, or one
# blocking socket the actor opens through Ray (cluster/serving/control/socket_channel.py; docs/operator-guide.md)
DRAFT_CHANNELS = ("ray", "socket")


def topology_label(topology: str, channel: str = "") -> str:
    """A measured unit's name, ``separated+socket`` where a draft channel is named (the benches' tables)."""
    return f"{topology}+{channel}" if channel else topology


def split_label(label: str) -> tuple[str, str]:
    """(topology, draft channel or "") of a :func:`topology_label`."""
    topology, _, channel = label.partition("+")
    return topology, channel


BACKENDS = ("auto", "gloo", "nccl")
# Ray placement-group strategies for the TP ranks; auto = STRICT_PACK (one node) with GPUs, PACK on CPU
TP_STRATEGIES = ("auto", "STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
PROXY_LOCATIONS = ("EveryNode", "HeadOnly")
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,252}")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9_.\-/]{0,63}")


def check_host(path: str, host: str) -> str:
    """An IP address to listen on (IPv4 or IPv6 literal), else a ConfigError naming ``path``."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"{path}: an IP address of this machine (e.g. 127.0.0.1, 0.0.0.0), got {host!r}") from None
    return host


@dataclass(frozen=True)
class ActorResources:
    """Ray resources of one actor (for a TP target: of each rank); ``threads`` = torch threads.

    Placement (docs/operator-guide.md, "A Ray cluster of many nodes"): ``resources`` asks for custom Ray resources
    (a node started with ``ray start --resources '{"node_drafters": 1}'`` offers them), ``labels`` for node labels
    (``ray start --labels accel=h100``; Ray's ``label_selector``).  Either pins the role to the nodes that have
    them."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def validate(self, path: str) -> None:
        if self.num_cpus < 0:
            raise ConfigError(f"{path}.num_cpus: must be >= 0, got {self.num_cpus}")
        if self.num_gpus < 0:
            raise ConfigError(f"{path}.num_gpus: must be >= 0, got {self.num_gpus}")
        if self.threads < 1:
            raise ConfigError(f"{path}.threads: must be >= 1, got {self.threads}")
        for name, amount in self.resources.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ConfigError(f"{path}.resources.{name}: a custom resource name (set {name} with num_cpus / "
                                  f"num_gpus / Ray's own options), got {name!r}")
            if not _NAME.fullmatch(name):
                raise ConfigError(f"{path}.resources: names of letters, digits, _ - . /, got {name!r}")
            if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not 0 < amount <= 1e6:
                raise ConfigError(f"{path}.resources.{name}: a number in (0, 1e6], got {amount!r}")
        for key, value in self.labels.items():
            if not _NAME.fullmatch(key) or not isinstance(value, str) or not _LABEL_VALUE.fullmatch(value):
                raise ConfigError(f"{path}.labels.{key}: a node label (key and value of letters, digits, "
                                  f"_ - . /; value up to 63 characters), got {value!r}")

    def ray_options(self) -> dict:
        """Options of ``ray.remote(...).options`` (and Serve's ``ray_actor_options``) for one such actor."""
        out = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            out["resources"] = dict(self.resources)
        if self.labels:
            out["label_selector"] = dict(self.labels)
        return out


SERVE_METRICS_INTERVAL_S = 10.0     # Ray Serve's default autoscaling metrics interval (ray.serve.config)


@dataclass(frozen=True)
class AutoscalingSpec:
    """Serve autoscaling of whole serving units: mapped onto Ray Serve's ``autoscaling_config`` (units =
    replicas of the deployment).  Serve adds a unit when the mean of ongoing requests per unit over
    ``look_back_period_s`` stays above ``target_ongoing_requests`` for ``upscale_delay_s``, and removes one
    (after draining it, see ``ClusterSpec.drain_timeout_s``) when it stays below for ``downscale_delay_s``."""

    min_units: int = 1
    max_units: int = 1
    initial_units: int | None = None          # None: min_units
    target_ongoing_requests: float | None = None   # per unit; None: the engine's max_batch
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    upscaling_factor: float | None = None     # Serve's multiplicative gain on a decision (None: 1)
    downscaling_factor: float | None = None

    def validate(self, path: str) -> None:
        if not 1 <= self.min_units <= 1024:
            raise ConfigError(f"{path}.min_units: must be in [1, 1024], got {self.min_units}")
        if not self.min_units <= self.max_units <= 1024:
            raise ConfigError(f"{path}.max_units: must be in [min_units={self.min_units}, 1024], "
                              f"got {self.max_units}")
        if self.initial_units is not None and not self.min_units <= self.initial_units <= self.max_units:
            raise ConfigError(f"{path}.initial_units: must be in [min_units={self.min_units}, "
                              f"max_units={self.max_units}], got {self.initial_units}")
        for name in ("target_ongoing_requests", "look_back_period_s", "upscaling_factor", "downscaling_factor"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(f"{path}.{name}: must be > 0, got {v}")
        if self.look_back_period_s <= SERVE_METRICS_INTERVAL_S:     # Serve warns now, will raise later
            raise ConfigError(f"{path}.look_back_period_s: must be > {SERVE_METRICS_INTERVAL_S:g} (Serve's autoscaling "
                              f"metrics interval), got {self.look_back_period_s}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{path}.{name}: must be >= 0, got {getattr(self, name)}")

    def serve_config(self, max_batch: int) -> dict:
        """Ray Serve's ``autoscaling_config`` for a deployment whose units batch ``max_batch`` requests."""
        out = {"min_replicas": self.min_units, "max_replicas": self.max_units,
               "initial_replicas": self.initial_units if self.initial_units is not None else self.min_units,
               "target_ongoing_requests": self.target_ongoing_requests or float(max_batch),
               "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
               "look_back_period_s": self.look_back_period_s}
        for name in ("upscaling_factor", "downscaling_factor"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class StreamSpec:
    """How a streamed response is paced (gRPC ``GenerateStream`` and HTTP server-sent events alike), as vLLM's
    ``--stream-interval``: the first chunk with tokens goes out at once; after it a chunk goes out when it holds
    ``interval_tokens`` tokens or ``interval_ms`` (null: no time bound) have passed since the last one, or the
    request ends.  Chunks a slow reader has not taken yet are always merged (cluster/serving/control/chunks.py)."""

    interval_tokens: int = 16
    interval_ms: float | None = 250.0

    def validate(self, path: str) -> None:
        if not 1 <= self.interval_tokens <= 4096:
            raise ConfigError(f"{path}.interval_tokens: must be in [1, 4096], got {self.interval_tokens}")
        if self.interval_ms is not None and not 0 < self.interval_ms <= 60_000:
            raise ConfigError(f"{path}.interval_ms: must be in (0, 60000] (or null: no time bound), "
                              f"got {self.interval_ms}")


@dataclass(frozen=True)
class ClusterSpec:
    topology: str = "auto"
    draft_channel: str = "ray"        # the draft-group actor's per-step calls: DRAFT_CHANNELS
    target_placement: str = "coordinator"   # tp_size 1: the target in the coordinator's process, or an actor
    tp_size: int = 1                  # target ranks (one placement group)
    tp_strategy: str = "auto"         # that group's Ray strategy (TP_STRATEGIES)
    backend: str = "auto"             # torch.distributed backend for TP: auto = nccl on GPU, else gloo
    target: ActorResources = field(default_factory=ActorResources)        # per TP rank
    drafters: ActorResources = field(default_factory=ActorResources)      # per drafter actor (separated)
    coordinator: ActorResources = field(default_factory=lambda: ActorResources(num_cpus=1.0))
    replicas: int = 1                 # serving units (Serve replicas); or scaled by `autoscaling`
    autoscaling: AutoscalingSpec | None = None
    drain_timeout_s: float = 120.0    # a unit being removed finishes its requests for up to this long
    # while Ray restarts a lost target (or the unit rebuilds its TP group) Serve's health check passes for up to
    # this long, so the unit's requests wait and resume on it instead of Serve replacing the unit, requests and all
    target_restart_grace_s: float = 60.0
    app_name: str = "specserve"
    grpc_port: int = 9000
    # where `specserve up`'s gRPC proxy listens (docs/operator-guide.md, "Secure"): loopback unless named; TLS when
    # both PEM files are set.  KubeRay / `serve deploy` ignore these (Serve binds [::]; TLS at the ingress).
    grpc_host: str = "127.0.0.1"
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    # Serve proxies: on every node (KubeRay's worker readiness asks the local one) or the head only (one
    # machine running several Ray nodes: their proxies would compete for the same ports)
    proxy_location: str = "EveryNode"
    # auth (docs/operator-guide.md, "Secure"): the API key from this file (a mounted secret) if set, else from the
    # environment variable; neither: auth off.  The operator key also sees other clients' request ids.
    api_key_env: str = "SPECSERVE_API_KEY"
    api_key_file: str | None = None
    operator_key_env: str = "SPECSERVE_OPERATOR_KEY"
    warmup_tokens: int = 4            # tokens generated per strategy before health says SERVING
    call_timeout_s: float = 30.0      # a model call that takes longer marks the model down (UNAVAILABLE)
    stream: StreamSpec = field(default_factory=StreamSpec)    # pacing of streamed responses

    def validate(self, path: str) -> None:
        for name, choices in (("target_placement", TARGET_PLACEMENTS), ("topology", TOPOLOGIES),
                              ("draft_channel", DRAFT_CHANNELS), ("tp_strategy", TP_STRATEGIES),
                              ("proxy_location", PROXY_LOCATIONS), ("backend", BACKENDS)):
            check_config_choice(f"{path}.{name}", getattr(self, name), choices)
        for name, low, high in (("tp_size", 1, 1024),
                                ("replicas", 1, 1024), ("grpc_port", 1, 65535), ("http_port", 1, 65535),
                                ("warmup_tokens", 0, 1024)):
            v = getattr(self, name)
            if not low <= v <= high:
                raise ConfigError(f"{path}.{name}: must be in [{low}, {high}], got {v}")
        if self.grpc_port == self.http_port:
            raise ConfigError(f"{path}.grpc_port: must differ from http_port ({self.http_port})")
        if self.autoscaling is not None:
            if self.replicas != 1:
                raise ConfigError(f"{path}.replicas: leave it out with autoscaling (use "
                                  f"autoscaling.initial_units), got {self.replicas}")
            self.autoscaling.validate(f"{path}.autoscaling")
        for name in ("drain_timeout_s", "target_restart_grace_s"):
            if not 0 <= getattr(self, name) <= 86400:
                raise ConfigError(f"{path}.{name}: must be in [0, 86400], got {getattr(self, name)}")
        if self.call_timeout_s <= 0:
            raise ConfigError(f"{path}.call_timeout_s: must be > 0, got {self.call_timeout_s}")
        if not self.app_name or not self.app_name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{path}.app_name: letters, digits, - and _ only, got {self.app_name!r}")
        for name in ("api_key_env", "operator_key_env"):
            v = getattr(self, name)
            if not v or not (v[0].isalpha() or v[0] == "_") or not v.replace("_", "").isalnum() or not v.isascii():
                raise ConfigError(f"{path}.{name}: an environment variable name, got {v!r}")
        check_host(f"{path}.grpc_host", self.grpc_host)
        if (self.grpc_tls_cert is None) != (self.grpc_tls_key is None):
            raise ConfigError(f"{path}.grpc_tls_cert / grpc_tls_key: both PEM files or neither, got cert="
                              f"{self.grpc_tls_cert!r}, key={self.grpc_tls_key!r}")
        if self.api_key_file is not None and not self.api_key_file:
            raise ConfigError(f"{path}.api_key_file: a path or null, got ''")
        for name in ("target", "drafters", "coordinator", "stream"):
            getattr(self, name).validate(f"{path}.{name}")
        if self.backend == "nccl" and self.target.num_gpus < 1 and self.tp_size > 1:
            raise ConfigError(f"{path}.backend: nccl needs target.num_gpus >= 1 per rank, "
                              f"got {self.target.num_gpus}")

    def placement(self) -> tuple[str, str]:
        """(``separated``, ``colocated`` or ``speculator``, why): the topology ``auto`` stands for, decided here only.
        Where the draft side has a whole device of its own (``drafters.num_gpus >= 1``: GPU nodes) drafting in its
        own actor runs beside verification.  A fraction of a GPU is no device of its own: Ray may pack the fractions
        onto one device, where the draft actor's kernels time-share it with the target's.  Where it has none, the
        drafters run in the coordinator: a draft actor would share the cores (or the device) that verification,
        Serve's proxy and the clients use, and the served suite, which prints this choice beside the fastest
        topology it measured (``bench --suite served``), found the speculator level with colocated drafting or
        behind it at one client, the only load it speculates at (docs/operator-guide.md, "Topologies")."""
        if self.topology != "auto":
            return self.topology, "named in the config"
        if self.drafters.num_gpus >= 1:
            return "separated", "auto: the draft side has a device of its own (drafters.num_gpus >= 1)"
        return "colocated", (f"auto: the draft side has no device of its own (drafters.num_gpus = "
                             f"{self.drafters.num_gpus:g}): the drafters run in the coordinator")

    def tp_placement(self) -> str:
        """The TP group's placement-group strategy: one node (STRICT_PACK) for GPUs unless asked otherwise."""
        if self.tp_strategy != "auto":
            return self.tp_strategy
        return "STRICT_PACK" if self.target.num_gpus else "PACK"

    def tp_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.target.num_gpus >= 1 else "gloo"
