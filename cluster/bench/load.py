"""``specserve bench --suite load``: closed-loop load, throughput and latency vs concurrency.

At each concurrency ``c`` (``--concurrency``, default 1,2,4,8,16,32) ``c`` clients each send their next
request as soon as the previous one has finished, ``2 * c`` requests per level (held-out prompts cycled,
``ignore_eos`` so every request generates exactly ``--max-new-tokens``).  Rows: autoregressive,
speculative with the config's drafter and k, and CS Drafting (default options, where the models allow it), all
on the SAME engine (the config's, ``engine.plain_from_batch`` included) so nothing differs but the strategy.  Per level every row runs in turn on the same prompts (and each runtime in turn), so ratios
are side by side on a noisy machine.  Every level keeps 2 * c requests: on the embedded family
(configs/local.yaml) the default run, both runtimes, takes about 2.5 minutes here (cluster start-up
~12-18 s of it), so no level is cut down.

Runtimes (``--runtime``, default both): ``in-process`` drives ``engine.step()`` in this thread; ``cluster``
is a :class:`Coordinator` on local Ray (its step loop in a background thread) with the clients as asyncio
tasks iterating ``coord.stream(req)``.  Per request: TTFT = first chunk - submit, TPOT = (last chunk -
first chunk) / (tokens - 1); per level: aggregate output tokens/s and the mean batch (engine rows per step).
"""
from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from cluster.bench.load_report import goal_lines, lossless_line, make_table, plot
from cluster.bench.report import RUNTIMES, Timed, local_ray, parse_ints, parse_runtimes, pct, print_table, write_results
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError, check_float, check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine

LEVELS = (1, 2, 4, 8, 16, 32)
WARMUP_TOKENS = 4


def parse_concurrency(text) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (sorted, distinct; each in [1, 1024])."""
    return sorted(set(parse_ints("concurrency", text, 1, 1024)))


@dataclass
class _Rec(Timed):
    """One request as its client saw it, recorded chunk by chunk."""

    def on_chunk(self, chunk) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        if chunk.result is not None:
            self.token_ids = list(chunk.result.token_ids)


@dataclass
class Level:
    """One (runtime, row, concurrency) measurement: the requests and the engine's step counters."""

    runtime: str
    row: str
    c: int
    recs: list[_Rec]
    seconds: float
    steps: int
    rows: int
    phases: dict = field(default_factory=dict)   # in-process: join/full/drain -> [steps, seconds, tokens]

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.recs)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def tpot_p99(self) -> float:
        return pct([r.tpot for r in self.recs], 99)


@dataclass
class Results:
    table: list[dict]
    levels: dict[tuple[str, str, int], Level]
    prompts: list[list[int]]
    max_new: int
    greedy: bool


def rows_for(engine, cfg) -> dict[str, tuple[str, dict]]:
    """Row name -> (strategy, options), for the rows this engine can serve."""
    k = int(cfg.engine.options.get("k", 4))
    drafter = cfg.engine.options.get("drafter")
    fixed = {"k": k, **({"drafter": drafter} if drafter else {})}
    cands = {"autoregressive": ("autoregressive", {}), f"speculative k={k}": ("speculative", fixed),
             "cs_drafting": ("cs_drafting", {})}
    out = {}
    for name, (strategy, opts) in cands.items():
        try:
            engine.prepare(GenerationRequest(prompt_ids=[0], max_new_tokens=1, strategy=strategy, options=opts))
            out[name] = (strategy, opts)
        except ParamError as e:
            print(f"[bench load: row {name} skipped: {e}]")
    return out


def _requests(prompts, n, max_new, temperature, strategy, opts) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_ids=list(prompts[j % len(prompts)]), max_new_tokens=max_new,
                              sampling=SamplingParams(temperature), seed=j, strategy=strategy,
                              options=dict(opts), ignore_eos=True) for j in range(n)]


def drive_in_process(engine, reqs: list[GenerationRequest], c: int,
                     phases: dict | None = None) -> tuple[list[_Rec], float, int, int]:
    """Closed loop in this thread: ``c`` requests in flight; a finished one is replaced by the next.
    Returns (records in request order, seconds from the first submit to the last chunk, engine steps,
    engine rows advanced).  ``phases`` (a dict) receives, per kind of step, [steps, seconds, tokens emitted]:
    ``join`` a step that admits requests, ``full`` one of ``c`` rows, ``drain`` one of fewer (the run's end)."""
    recs: list[_Rec | None] = [None] * len(reqs)
    done: list = []
    emitted, joined = [0], [0]

    def submit(i: int) -> None:
        rec = recs[i] = _Rec(time.perf_counter())
        joined[0] += 1

        def on_chunk(chunk) -> None:
            emitted[0] += len(chunk.token_ids)
            rec.on_chunk(chunk)
        engine.add(reqs[i], on_chunk, done.append)

    s0, r0 = engine.steps, engine.step_rows
    t0 = time.perf_counter()
    nxt = min(c, len(reqs))
    for i in range(nxt):
        submit(i)
    while engine.has_work:
        rows, tokens, t = engine.step_rows, emitted[0], time.perf_counter()
        engine.step()
        if phases is not None:
            kind = "join" if joined[0] else "full" if engine.step_rows - rows >= c else "drain"
            acc = phases.setdefault(kind, [0, 0.0, 0])
            acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + time.perf_counter() - t, acc[2] + emitted[0] - tokens
        joined[0] = 0
        while done:
            seq = done.pop(0)
            if seq.error is not None:
                raise seq.error
            if nxt < len(reqs):
                submit(nxt)
                nxt += 1
    return recs, max(r.last for r in recs) - t0, engine.steps - s0, engine.step_rows - r0


class ClusterDriver:
    """Closed loop against the coordinator: ``c`` asyncio clients iterating ``coord.stream``.  One event
    loop for the whole run (the coordinator's step thread posts each request's end to the loop after its
    last chunk, so the loop must outlive a level); after a level it waits for the engine to go idle
    (the last request's release), untimed, so levels never overlap."""

    def __init__(self, coord):
        self.coord = coord
        self.loop = asyncio.new_event_loop()

    def __call__(self, reqs: list[GenerationRequest], c: int) -> tuple[list[_Rec], float, int, int]:
        recs: list[_Rec | None] = [None] * len(reqs)
        order = iter(range(len(reqs)))
        coord = self.coord

        async def client() -> None:
            for i in order:                      # shared: each client takes the next request when free
                rec = recs[i] = _Rec(time.perf_counter())
                async for chunk in coord.stream(reqs[i]):
                    rec.on_chunk(chunk)

        async def main() -> None:
            await asyncio.gather(*(client() for _ in range(min(c, len(reqs)))))

        engine = coord.engine
        s0, r0 = engine.steps, engine.step_rows
        t0 = time.perf_counter()
        self.loop.run_until_complete(main())
        wall = max(r.last for r in recs) - t0
        deadline = time.perf_counter() + 60.0
        while engine.has_work and time.perf_counter() < deadline:
            time.sleep(0.001)
        return recs, wall, engine.steps - s0, engine.step_rows - r0

    def close(self) -> None:
        self.loop.run_until_complete(asyncio.sleep(0))     # drain the step thread's posted callbacks
        self.loop.close()


def collect(args, cfg) -> Results:
    """Measure, print the table and the goals, write ``bench_load.{csv,json,png}`` to ``args.out``.  Ray and the
    coordinator are imported only for the cluster runtime: ``--runtime in-process`` needs torch and transformers
    alone (the gpu suite runs it on a lent device, which has no Ray)."""
    n = check_int("prompts", args.prompts, 1, 256)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    temperature = check_float("temperature", args.temperature, 0.0, 100.0)
    levels = parse_concurrency(getattr(args, "concurrency", None) or ",".join(map(str, LEVELS)))
    runtimes = parse_runtimes(getattr(args, "runtime", None) or ",".join(RUNTIMES))
    cap = cfg.engine.max_batch + cfg.engine.max_queue
    if levels[-1] > cap:
        raise ParamError("concurrency", f"at most engine.max_batch + engine.max_queue = {cap}", levels[-1])
    engine = build_engine(cfg)
    prompts = [p["prompt_ids"] for p in heldout_prompts(engine.tokenizer, n)]
    rows = rows_for(engine, cfg)
    drivers = {}
    if "in-process" in runtimes:
        drivers["in-process"] = lambda reqs, c, phases=None: drive_in_process(engine, reqs, c, phases)
    with ExitStack() as stack:
        if "cluster" in runtimes:
            from cluster.serving.control.coordinator import Coordinator

            stack.enter_context(local_ray())
            t0 = time.perf_counter()
            coord = Coordinator(cfg)
            stack.callback(coord.shutdown)
            print(f"[bench load: cluster up in {time.perf_counter() - t0:.1f}s (topology {coord.topology})]")
            drivers["cluster"] = cdriver = ClusterDriver(coord)
            stack.callback(cdriver.close)
        for rt, drive in drivers.items():            # warm-up (not timed): every row at the largest level
            for strategy, opts in rows.values():
                drive(_requests(prompts, levels[-1], min(WARMUP_TOKENS, max_new), temperature, strategy, opts),
                      levels[-1])
        measured: dict[tuple[str, str, int], Level] = {}
        bar = tqdm(total=len(levels) * len(rows) * len(drivers), desc="bench load", unit="run")
        for c in levels:
            for name, (strategy, opts) in rows.items():
                for rt, drive in drivers.items():
                    bar.set_postfix_str(f"c={c} {name} {rt}")
                    reqs, phases = _requests(prompts, 2 * c, max_new, temperature, strategy, opts), {}
                    recs, secs, steps, nrows = drive(reqs, c, phases) if rt == "in-process" else drive(reqs, c)
                    measured[(rt, name, c)] = Level(rt, name, c, recs, secs, steps, nrows, phases)
                    bar.update()
        bar.close()
    table = make_table(measured, list(drivers), list(rows), levels)
    title = (f"load: closed loop, 2*c requests per level, {len(prompts)} held-out prompts cycled x {max_new} "
             f"tokens, temperature {temperature:g}, config {cfg.source}; ttft/tpot in ms")
    print_table(table, title)
    out = Path(args.out)
    write_results(table, out, "bench_load")
    try:
        plot(measured, list(drivers), list(rows), levels, out / "bench_load.png")
        print(f"results written to {out / 'bench_load'}.{{csv,json,png}}")
    except ImportError as e:                       # a lent device machine may have no matplotlib
        print(f"results written to {out / 'bench_load'}.{{csv,json}}; no plot ({e})")
    if temperature == 0:
        print(lossless_line(measured))
    for line in goal_lines(measured, list(drivers), list(rows), levels):
        print(line)
    return Results(table, measured, prompts, max_new, temperature == 0)


def run(args, cfg) -> int:
    collect(args, cfg)
    return 0
