"""The transport suite's measuring loop, driven in-process (the Ray transports run in `--suite transport`)."""
import os

from cluster.bench.transport import PAYLOADS, Echo, _cpu_seconds, _measure


def test_measure_reports_round_trips_and_cpu_of_both_sides():
    echo = Echo()
    sent = []

    def send(args):
        sent.append(args)
        return echo.call(args)

    row = _measure(send, os.getpid(), n=5)
    for label in PAYLOADS:
        assert 0 < row[f"{label} p50 ms"] <= row[f"{label} p90 ms"]
    assert {len(p) for p, s in sent if s == 0} == set(PAYLOADS.values())
    assert sum(1 for _, s in sent if s > 0) == 10                      # the waiting phase: 10 calls of 20 ms
    assert 0 <= row["idle: caller CPU s/s"] < 0.5                      # sleeping, not polling
    assert row["waiting: caller CPU s/s"] < 0.5                        # time.sleep in this process: no CPU


def test_cpu_seconds_grows_with_work():
    before = _cpu_seconds(os.getpid())
    x = 0
    for i in range(3_000_000):
        x += i
    assert _cpu_seconds(os.getpid()) > before
