"""Run a load test from any process (the CLI, a test, a process that runs Ray): :func:`run_loadtest`.

The load itself comes from a locust worker in a child process (:mod:`cluster.loadtest.worker`), because
locust monkey-patches the process it is imported in.  This side writes the worker's job file, reads its
records as they come (one JSON line per finished request), samples the serving replicas from the
``replicas`` callable in a thread, shows progress, checks greedy outputs, and builds the per-stage table,
the timeline and the output files.  A run is bounded: the worker is killed if it outlives every stage's
duration plus one request deadline per stage plus a start-up allowance.

    from cluster.loadtest import LoadSpec, Target, parse_stages, run_loadtest
    spec = LoadSpec(stages=parse_stages("rate=2:20s,c=8:20s"))
    res = run_loadtest(spec, prompts, Target("127.0.0.1:9000", "http://127.0.0.1:8000"), out_dir=Path("out"))
    assert res.failed == 0, res.failures
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from cluster.loadtest.checks import (
    LoadTestError,
    check_greedy,
    greedy_references,
    preflight,
)
from cluster.loadtest.clients import Target
from cluster.loadtest.report import format_table, write_outputs
from cluster.loadtest.spec import LoadSpec
from cluster.loadtest.stats import auto_bin, summarize, timeline

STARTUP_S = 60.0                 # the worker's imports and its first stage's start
EXIT_S = 30.0                    # the worker's exit after its last record
REFRESH_S = 0.2                  # progress display refresh
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LoadResult:
    stages: list[dict]                                  # one summary row per stage (see stats.summarize)
    requests: list[dict]                                # every request, times relative to the run's start
    timeline: list[dict]
    replicas: list[tuple[float, int | None]]            # (seconds since start, count) samples
    greedy: dict = field(default_factory=dict)          # {"checked": n, "mismatched": n} when checked
    files: dict[str, Path] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    stage_windows: list[dict] = field(default_factory=list)   # {stage, label, start_s, end_s}

    @property
    def failures(self) -> Counter:
        return Counter(r["status"] for r in self.requests if r["status"] != "OK")

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @property
    def table(self) -> str:
        return format_table(self.stages)


class _Sampler(threading.Thread):
    """Calls ``replicas()`` every ``every_s`` seconds until stopped; a failing call samples None."""

    def __init__(self, replicas: Callable[[], int], every_s: float):
        super().__init__(daemon=True, name="loadtest-replicas")
        self.replicas, self.every_s = replicas, every_s
        self.samples: list[tuple[float, int | None]] = []
        self.error: str | None = None
        self.stop = threading.Event()

    def sample(self) -> None:
        try:
            self.samples.append((time.monotonic(), int(self.replicas())))
        except Exception as e:                       # noqa: BLE001 - a flaky status call must not end the run
            self.samples.append((time.monotonic(), None))
            self.error = self.error or f"{type(e).__name__}: {e}"

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.every_s)            # the sampling period


def _reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(json.loads(line))
    q.put(None)


def run_loadtest(spec: LoadSpec, prompts: list[str], target: Target, *, out_dir: Path | None = None,
                 replicas: Callable[[], int] | None = None, sample_s: float = 1.0, greedy_check: bool = False,
                 expected: dict | None = None, reference_strategy: str = "autoregressive",
                 progress: bool = True, plot: bool = True, check_first: bool = True) -> LoadResult:
    """Run every stage of ``spec`` against ``target`` and return the summaries (and write the files to
    ``out_dir`` if given).  ``greedy_check``: compare each greedy request's tokens with ``expected``
    ({(prompt index, max_new_tokens, ignore_eos): token ids}) or, without it, with references fetched
    first with ``reference_strategy``.  Raises :class:`LoadTestError` if the preflight is refused or nothing
    answers, the worker fails, or the run passes its time bound."""
    if not prompts:
        raise LoadTestError("no prompts")
    if check_first:
        preflight(spec, prompts[0], target)
    if greedy_check and expected is None:
        expected = greedy_references(spec, prompts, target, reference_strategy)
    job = {"spec": spec.to_dict(), "target": target.to_dict(), "prompts": prompts, "keep_tokens": greedy_check}
    work = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="specserve-loadtest-"))
    work.mkdir(parents=True, exist_ok=True)
    job_path, log_path = work / "loadtest_job.json", work / "loadtest_worker.log"
    job_path.write_text(json.dumps(job))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}           # the worker imports this checkout's cluster package
    sampler = _Sampler(replicas, sample_s) if replicas is not None else None
    bound = spec.time_bound_s + STARTUP_S + 10.0 * len(spec.stages)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gevent.monkey", "--module", "cluster.loadtest.worker",
                                 str(job_path)], stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        try:
            if sampler is not None:
                sampler.start()
            msgs = _collect(proc, spec, bound, progress)
            proc.wait(timeout=EXIT_S)                  # it exits once it has sent "done"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if sampler is not None:
                sampler.stop.set()
                sampler.join()
    if proc.returncode != 0 or not msgs or msgs[-1].get("t") != "done":
        tail = log_path.read_text()[-2000:]
        raise LoadTestError(f"the load worker failed (exit {proc.returncode}); its log ends:\n{tail}")
    samples, error = [], None
    if sampler is not None:
        sampler.sample()                             # one last sample at the end
        samples, error = sampler.samples, sampler.error
    result = build_result(spec, msgs, samples, expected if greedy_check else None, error)
    if out_dir is not None:
        result.files = write_outputs(Path(out_dir), result_json(result, spec, target, len(prompts)), plot=plot)
    return result


def _collect(proc, spec: LoadSpec, bound: float, progress: bool) -> list[dict]:
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
    deadline = time.monotonic() + bound
    total = sum(s.duration_s for s in spec.stages)
    bar = tqdm(total=round(total), unit="s", disable=not progress, file=sys.stderr, dynamic_ncols=True,
               bar_format="{desc} {bar} {n:.0f}/{total:.0f}s{postfix}")
    msgs, stage, stage_t0, done_before, shown = [], 0, None, 0.0, 0.0
    counts = Counter()
    try:
        while True:
            if time.monotonic() > deadline:
                raise LoadTestError(f"the load test passed its time bound of {bound:.0f}s; worker stopped")
            try:
                m = q.get(timeout=0.25)
            except queue.Empty:
                m = {"t": "idle"}
            if m is None:
                break
            if m["t"] not in ("tick", "idle"):
                msgs.append(m)
            if m["t"] == "stage":
                stage, stage_t0 = m["stage"], m["start"]
                done_before = sum(s.duration_s for s in spec.stages[:stage])
                bar.set_description_str(f"stage {stage + 1}/{len(spec.stages)} {spec.stages[stage].label}")
                counts = Counter()
            elif m["t"] == "req":
                counts["ok" if m["status"] == "OK" else "failed"] += 1
            elif m["t"] == "tick":
                counts["sent"], counts["in_flight"] = m["sent"], m["in_flight"]
            elif m["t"] == "stage_end":
                counts["sent"], counts["in_flight"] = m["sent"], 0
            if stage_t0 is not None and (m["t"] in ("stage", "stage_end") or time.monotonic() - shown >= REFRESH_S):
                shown = time.monotonic()
                bar.n = min(total, done_before + min(time.monotonic() - stage_t0, spec.stages[stage].duration_s))
                bar.set_postfix(sent=counts["sent"], ok=counts["ok"], failed=counts["failed"],
                                in_flight=counts["in_flight"], refresh=False)
                bar.refresh()
            if m["t"] == "done":
                break
    finally:
        bar.close()
    return msgs


def build_result(spec: LoadSpec, msgs: list[dict], samples: list[tuple[float, int | None]] = (),
                 expected: dict | None = None, sampling_error: str | None = None) -> LoadResult:
    """The result from the worker's messages (``stage`` / ``req`` / ``stage_end``, times on the monotonic
    clock), replica ``samples`` on the same clock and the greedy references (None: no check)."""
    reqs = [m for m in msgs if m["t"] == "req"]
    starts = {m["stage"]: m["start"] for m in msgs if m["t"] == "stage"}
    ends = {m["stage"]: m for m in msgs if m["t"] == "stage_end"}
    warnings, greedy = [], {}
    if expected is not None:
        checked, mismatched = check_greedy(reqs, expected)
        greedy = {"checked": checked, "mismatched": mismatched}
    rows = []
    for i, stage in enumerate(spec.stages):
        recs = [r for r in reqs if r["stage"] == i]
        row = summarize(i, stage.to_dict(), recs, start=starts[i])
        end = ends[i]
        row["delayed_arrivals"] = end["delayed"]
        if expected is not None:
            row["greedy_checked"] = sum(1 for r in recs if r.get("greedy_checked"))
        if end["locust"]["requests"] != len(recs) or end["sent"] != len(recs):
            warnings.append(f"stage {i}: {len(recs)} records, {end['sent']} sent, locust counted "
                            f"{end['locust']['requests']}")
        rows.append(row)
    t0 = min(starts.values())
    t1 = max([m["end"] for m in ends.values()] + [r["start"] + r["e2e"] for r in reqs])
    if sampling_error:
        warnings.append(f"replica sampling failed at least once: {sampling_error}")
    tl = timeline(reqs, samples, t0, t1, auto_bin(t1 - t0))
    for r in reqs:
        r["start"] = round(r["start"] - t0, 6)
    windows = [{"stage": i, "label": s.label, "start_s": round(starts[i] - t0, 3),
                "end_s": round(ends[i]["end"] - t0, 3)} for i, s in enumerate(spec.stages)]
    return LoadResult(stages=rows, requests=reqs, timeline=tl, replicas=[(round(t - t0, 3), v) for t, v in samples],
                      greedy=greedy, warnings=warnings, stage_windows=windows)


def result_json(result: LoadResult, spec: LoadSpec, target: Target, n_prompts: int) -> dict:
    """Everything the run measured, as ``loadtest.json`` holds it."""
    return {"spec": spec.to_dict(), "target": target.to_dict(), "prompts": n_prompts, "stages": result.stages,
            "failures": dict(result.failures), "greedy": result.greedy, "warnings": result.warnings,
            "stage_windows": result.stage_windows, "timeline": result.timeline,
            "replicas": result.replicas, "requests": result.requests}
