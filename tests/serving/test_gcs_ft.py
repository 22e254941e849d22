"""GCS fault tolerance with a real Redis (issue 22 item 4), on the one-machine multi-node cluster
(tests/support/multinode.py): the head keeps its GCS tables in ``redis-server`` (started here, 127.0.0.1), its
GCS is stopped under 4 clients and started again from the same command line, as KubeRay's head restart does.

Serve's proxy (on the head) and the unit (on the workers) keep answering while the GCS is down (Ray's
documented promise with GCS fault tolerance); nothing in flight fails or comes back twice; with the GCS back the
cluster takes a new node, schedules on it and accepts a new Serve application.  Slow: ``python -m pytest -m slow
tests/serving/test_gcs_ft.py``.  Needs the system package ``redis-server`` (skipped, naming it, without).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
import yaml

from tests.serving.test_multinode import MAX_NEW, PROMPTS, _config, _free_port, reference  # noqa: F401 - fixture
from tests.support.load import Load
from tests.support.multinode import MultiNode
from tests.support.polling import poll

pytestmark = pytest.mark.slow


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("needs the system package redis-server (apt-get install redis-server)")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        poll(lambda: _accepts(port), "redis-server to listen", 30)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_answers_while_the_gcs_restarts(redis_port, reference, tmp_path):
    cfg = _config()
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    head_env = {"RAY_REDIS_ADDRESS": f"127.0.0.1:{redis_port}", "RAY_external_storage_namespace": "specserve-ft"}
    with MultiNode(tmp_path, _free_port(), head_env=head_env) as mn:
        mn.add_worker("node_a")
        mn.add_worker("node_b")
        up = mn.up(tmp_path / "cfg.yaml")
        assert up.returncode == 0, up.stderr[-3000:]
        (gcs,) = [p for p in mn.session_processes() if p.name() == "gcs_server"]
        command, env = gcs.cmdline(), gcs.environ()
        gcs_port = int(mn.address.rsplit(":", 1)[1])
        restarted = None
        try:
            with Load(f"127.0.0.1:{cfg['cluster']['grpc_port']}", PROMPTS, MAX_NEW, seconds=300) as load:
                poll(lambda: len(load.results) >= 4, "4 completions before the GCS stops", 60)
                os.kill(gcs.pid, signal.SIGKILL)  # a crash (the head runs without --block, which would stop it all)
                gcs.wait(30)
                down = time.monotonic()
                # down for as long as 100 answers take (seconds; a head pod restart takes longer, and raylets
                # wait 60 s for their GCS): the proxy and the unit need no GCS to serve
                poll(lambda: len(load.after(down)) >= 100, "answers while the GCS is down", 60)
                assert not _accepts(gcs_port)                               # still down while they came
                during = len(load.after(down))
                restarted = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True)
                back = time.monotonic()
                poll(lambda: _accepts(gcs_port), "the GCS to listen again", 60)
                mn.add_worker("node_c")                                     # scales: a new node joins
                new_app = mn.query(NEW_APP, timeout=180)
                after = len(load.after(back))
        finally:
            if restarted is not None:
                restarted.kill()                 # its SIGTERM shutdown hangs flushing events (Ray 2.60)
                restarted.wait(30)
    print(f"GCS restart: {during} answers in the {back - down:.1f}s it was down, {after} after; "
          f"{len(load.results)} requests, {len(load.failures)} failures; new node and application: {new_app}")
    assert not load.failures, load.failures[:5]
    assert all(toks == reference[p] for _, p, toks, _ in load.results)
    assert new_app[0] == mn.workers["node_c"].node_ip and new_app[1] == "RUNNING"


# a task on the new node and a new Serve application on it, through the restarted GCS
NEW_APP = """from ray import serve
@ray.remote(num_cpus=0.1, resources={'node_c': 0.01})
def where(): return ray.util.get_node_ip_address()
@serve.deployment(ray_actor_options={'num_cpus': 0.1, 'resources': {'node_c': 0.01}})
class Probe:
    def __call__(self, req): return 'ok'
serve.run(Probe.bind(), name='ft-probe', route_prefix='/ft-probe')
emit([ray.get(where.remote(), timeout=60), serve.status().applications['ft-probe'].status])
"""
