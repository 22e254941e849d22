"""Autoscaling under a load test (slow; ``python -m pytest -m slow tests/serving/test_autoscaling.py -s``).

configs/tiny-autoscale.yaml (1 to 3 serving units) is deployed as a second application on the session's Serve
instance, and ``specserve loadtest``'s engine drives configs/loadtest-autoscale.yaml at it: traffic ramps up,
holds, ramps down and trickles.  Serve must add units and remove them again; every request succeeds with the
exact greedy output; a removed unit leaves no actor behind.  The timeline plot goes to
``$SPECSERVE_AUTOSCALE_OUT`` (default: the test's tmp dir) and the numbers are printed.
"""
from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from cluster.config.schema import load_config
from cluster.loadtest import Target, run_loadtest, serve_replicas
from cluster.loadtest.spec import load_spec
from tests.support.polling import poll

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
APP = "autoscale"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def main():\n    args = ", "with open(path) as f:\n"]


def _unit_actors() -> collections.Counter:
    """Live actors that serving units start (model hosts, Max-Gram, TP ranks), by class."""
    # Ray's GCS actor table (a private API of the pinned Ray; the state API needs the dashboard)
    from ray._private.state import actors
    return collections.Counter(a["ActorClassName"] for a in actors().values()
                               if a["State"] != "DEAD" and a["ActorClassName"] in ("ModelHost", "DraftHost", "TPRank"))


def test_units_scale_up_and_down_under_load_with_no_failures(served, tmp_path):
    from ray import serve

    from cluster.serving.fronts.app import build_app
    cfg, _ = served
    acfg = load_config(ROOT / "configs" / "tiny-autoscale.yaml")
    before = _unit_actors()
    serve.run(build_app(acfg), name=APP, route_prefix=f"/{APP}")
    count = serve_replicas(APP)
    assert count() == acfg.cluster.autoscaling.min_units == 1
    one_unit = _unit_actors() - before                  # what one unit starts (separated: its draft-group actor)
    assert one_unit == collections.Counter({"DraftHost": 1}), one_unit
    out = Path(os.environ.get("SPECSERVE_AUTOSCALE_OUT", tmp_path))
    try:
        result = run_loadtest(load_spec(ROOT / "configs" / "loadtest-autoscale.yaml"), PROMPTS,
                              Target(grpc=f"127.0.0.1:{cfg.cluster.grpc_port}",
                                     http=f"http://127.0.0.1:{cfg.cluster.http_port}", app=APP),
                              out_dir=out, replicas=count, greedy_check=True, progress=False)
        print("\n" + result.table)
        replicas = [n for _, n in result.replicas if n is not None]
        print(f"replicas sampled: {len(replicas)}; max {max(replicas)}; at the end {replicas[-1]}; "
              f"timeline: {out / 'loadtest_timeline.png'}")
        assert result.failed == 0, result.failures
        assert result.greedy["checked"] > 0 and result.greedy["mismatched"] == 0
        assert max(replicas) >= 2, "Serve added no unit under load"
        poll(lambda: count() == 1, "Serve to remove the extra units", timeout=120)
        extra = _unit_actors() - before                 # the one remaining unit's actors, nothing else
        poll(lambda: (_unit_actors() - before) == one_unit,
             f"removed units' actors to stop (now {dict(extra)})", timeout=60)
    finally:
        serve.delete(APP)
    poll(lambda: _unit_actors() == before, "the deleted app's actors to stop", timeout=60)
