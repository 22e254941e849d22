"""The ``cluster:`` section's placement and listening keys (cluster/config/layout.py): what they map to in Ray,
and the one-line error each bad value gets."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config.layout import split_label, topology_label
from cluster.config.schema import config_from_dict
from cluster.errors import ConfigError
from cluster.serving.ops.deploy import deployment_options

TINY = yaml.safe_load((Path(__file__).parents[2] / "configs" / "tiny.yaml").read_text())


def _cfg(**cluster):
    return config_from_dict({**TINY, "cluster": {**TINY["cluster"], **cluster}})


def test_placement_maps_onto_ray_options():
    cfg = _cfg(target={"num_cpus": 0.5, "resources": {"node_target": 1}, "labels": {"accel": "h100"}},
               drafters={"num_cpus": 0.1, "resources": {"node_drafters": 0.5}},
               coordinator={"num_cpus": 0.1, "resources": {"node_head": 0.01}}, tp_strategy="STRICT_SPREAD")
    cl = cfg.cluster
    assert cl.target.ray_options() == {"num_cpus": 0.5, "num_gpus": 0.0, "resources": {"node_target": 1.0},
                                       "label_selector": {"accel": "h100"}}
    assert cl.drafters.ray_options()["resources"] == {"node_drafters": 0.5}
    assert deployment_options(cfg)["ray_actor_options"] == {"num_cpus": 0.1, "num_gpus": 0.0,
                                                            "resources": {"node_head": 0.01}}
    assert cl.tp_placement() == "STRICT_SPREAD"
    assert _cfg().cluster.tp_placement() == "PACK"                       # CPU ranks: auto = PACK
    assert _cfg(target={"num_gpus": 1}).cluster.tp_placement() == "STRICT_PACK"   # GPU ranks: one node
    assert _cfg().cluster.grpc_host == "127.0.0.1"                       # loopback unless named


@pytest.mark.parametrize("section,words", [
    ({"drafters": {"resources": {"CPU": 1}}}, ["cluster.drafters.resources.CPU", "num_cpus"]),
    ({"target": {"resources": {"node_a": 0}}}, ["cluster.target.resources.node_a", "(0, 1e6]", "0"]),
    ({"target": {"resources": {"node a": 1}}}, ["cluster.target.resources", "'node a'"]),
    ({"coordinator": {"labels": {"zone": "a b"}}}, ["cluster.coordinator.labels.zone", "'a b'"]),
    ({"tp_strategy": "RANDOM"}, ["cluster.tp_strategy", "STRICT_PACK", "'RANDOM'"]),
    ({"grpc_host": "example.com"}, ["cluster.grpc_host", "IP address", "'example.com'"]),
    ({"grpc_tls_cert": "c.pem"}, ["grpc_tls_key", "both", "'c.pem'"]),
])
def test_bad_placement_names_field(section, words):
    with pytest.raises(ConfigError) as e:
        _cfg(**section)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("topology,channel,label", [("separated", "socket", "separated+socket"),
                                                    ("separated", "ray", "separated+ray"),
                                                    ("colocated", "", "colocated"), ("speculator", "", "speculator")])
def test_topology_labels_name_the_draft_channel_only_where_one_is_given(topology, channel, label):
    assert topology_label(topology, channel) == label
    assert split_label(label) == (topology, channel)
