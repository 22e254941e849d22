"""Streamed chunks between the step thread and a request's event loop (cluster/serving/control/chunks.py): coalescing
keeps every token, text piece and logprob in order, the first chunk is never held, the stream interval holds the
rest by tokens or time, one wake-up per loop per step; and ``cluster.stream`` is validated by field name."""
from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.config.schema import config_from_dict, load_config
from cluster.engine.request import GenerationRequest, StreamChunk
from cluster.errors import ConfigError
from cluster.serving.control.chunks import ChunkBox, StepDelivery, due, merge_chunks, paced, wake_rule


class Ended:
    """The ended-sequence marker a box receives after the last chunk (as the coordinator's ``on_end``)."""

    def __init__(self, error=None):
        self.error = error


def _is_end(item) -> bool:
    return isinstance(item, Ended)


def _engine_chunks(engine, n=12, logprobs=2) -> list[StreamChunk]:
    req = GenerationRequest(prompt="def f(x):", max_new_tokens=n, seed=3, ignore_eos=True, logprobs=logprobs,
                            strategy="speculative", options={"k": 3})
    return list(engine.stream(req))


def _count_wake_ups(loop, calls: list) -> None:
    """Append each ``call_soon_threadsafe`` callback of ``loop`` to ``calls`` (one wake-up each)."""
    real = loop.call_soon_threadsafe

    def counting(cb, *args):
        calls.append(cb)
        return real(cb, *args)

    loop.call_soon_threadsafe = counting


def _on_a_thread(fn, *args) -> None:
    """Run ``fn(*args)`` on a thread of its own (as the step thread would) and wait for it."""
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join()


async def _collect(box, **kw) -> list[StreamChunk]:
    return [c async for c in paced(box, _is_end, **kw)]


def test_coalescing_keeps_every_token_logprob_and_text_in_order(tiny_engine):
    chunks = _engine_chunks(tiny_engine)
    assert len(chunks) > 2                          # several engine steps to merge
    result = chunks[-1].result

    async def main():
        box = ChunkBox(asyncio.get_running_loop())
        for c in chunks:                            # a slow reader: everything is pending before it reads
            box.put(c)
        box.put(Ended())
        return await _collect(box)

    out = asyncio.run(main())
    assert len(out) == 1
    (merged,) = out
    assert merged.token_ids == result.token_ids
    assert merged.text == result.text
    assert [lp.token_id for lp in merged.logprobs] == result.token_ids
    assert merged.logprobs == result.logprobs
    assert merged.finish_reason == result.finish_reason and merged.result is result


def test_merge_without_logprobs_and_of_one():
    a, b = StreamChunk([1, 2], "ab"), StreamChunk([3], "c", "length")
    assert merge_chunks([a]) is a
    m = merge_chunks([a, b])
    assert (m.token_ids, m.text, m.finish_reason, m.logprobs) == ([1, 2, 3], "abc", "length", None)


def test_first_chunk_is_never_held_then_interval_tokens_groups_the_rest():
    async def main():
        box = ChunkBox(asyncio.get_running_loop())
        gen = paced(box, _is_end, interval_tokens=5)
        box.put(StreamChunk([1], "a"))
        first = await asyncio.wait_for(gen.__anext__(), 5)      # out with 1 token, under the interval of 5
        assert first.token_ids == [1]
        for i in range(2, 5):                        # 3 tokens: held
            box.put(StreamChunk([i], "x"))
        box.put(StreamChunk([5, 6], "yy"))           # 5 held now: out together
        second = await asyncio.wait_for(gen.__anext__(), 5)
        box.put(StreamChunk([7], "z", "length"))     # the end goes out whatever the interval
        third = await asyncio.wait_for(gen.__anext__(), 5)
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        return second, third

    second, third = asyncio.run(main())
    assert second.token_ids == [2, 3, 4, 5, 6] and second.text == "xxxyy"
    assert third.token_ids == [7] and third.finish_reason == "length"


def test_interval_ms_sends_what_is_held_when_the_time_is_up():
    async def main():
        box = ChunkBox(asyncio.get_running_loop())
        gen = paced(box, _is_end, interval_tokens=1000, interval_ms=30)
        box.put(StreamChunk([1], "a"))
        await gen.__anext__()
        box.put(StreamChunk([2], "b"))                # held: 1 token of 1000; nothing more ever comes
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        chunk = await asyncio.wait_for(gen.__anext__(), 10)
        return chunk, loop.time() - t0

    chunk, waited = asyncio.run(main())
    assert chunk.token_ids == [2]
    assert waited >= 0.02                         # held until its interval had passed


def test_a_failed_request_sends_what_it_held_then_raises():
    async def main():
        box = ChunkBox(asyncio.get_running_loop())
        got = []
        box.put(StreamChunk([1], "a"))
        box.put(StreamChunk([2], "b"))
        box.put(Ended(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            async for c in paced(box, _is_end, interval_tokens=100):
                got.append(c)
        return got

    got = asyncio.run(main())
    assert [t for c in got for t in c.token_ids] == [1, 2]


def test_whole_gives_one_chunk_with_everything():
    async def main():
        box = ChunkBox(asyncio.get_running_loop())
        gen = paced(box, _is_end, whole=True)
        for i in range(4):
            box.put(StreamChunk([i], str(i)))
        box.put(StreamChunk([9], "9", "length"))
        return [c async for c in gen]

    (only,) = asyncio.run(main())
    assert only.token_ids == [0, 1, 2, 3, 9] and only.text == "01239"


def test_one_wake_up_per_loop_per_step():
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        _count_wake_ups(loop, calls)
        delivery = StepDelivery()
        boxes = [ChunkBox(loop, delivery) for _ in range(8)]

        def step(i):                                  # the step thread: every request gets a chunk
            for b in boxes:
                b.put(StreamChunk([i], "x"))
            delivery.deliver()

        for i in range(3):                            # three steps before any reader runs
            _on_a_thread(step, i)
        return [await b.take() for b in boxes]

    taken = asyncio.run(main())
    assert len(calls) == 1                            # marked once: later puts found the box still signalled
    assert all([c.token_ids for c in items] == [[0], [1], [2]] for items in taken)


@pytest.mark.parametrize("field,value,needle", [
    ("interval_tokens", 0, "cluster.stream.interval_tokens: must be in [1, 4096], got 0"),
    ("interval_ms", -5, "cluster.stream.interval_ms: must be in (0, 60000]"),
    ("interval_tokens", "four", "cluster.stream.interval_tokens: expected int"),
    ("every", 2, "cluster.stream.every: unknown field"),
])
def test_stream_config_errors_name_the_field(field, value, needle):
    data = {"models": {"target": {"tiny": {}}}, "cluster": {"stream": {field: value}}}
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert needle in str(e.value)


def test_shipped_configs_parse_the_stream_section():
    for path in ("configs/tiny.yaml", "configs/local.yaml"):
        s = load_config(path).cluster.stream
        assert s.interval_tokens >= 1


@pytest.mark.parametrize("woken", [False, True])
def test_a_cancelled_reader_is_cancelled_even_as_its_chunk_arrives(woken):
    """A stream's reader cancelled while it waits out the interval must see the cancellation (the coordinator
    then aborts the request), also when a chunk arrives in the same loop iteration: ``asyncio.wait_for`` before
    Python 3.12 returned the chunk and swallowed the cancel, and the cancelled request ran to its end."""
    async def main():
        box = ChunkBox(asyncio.get_running_loop())
        gen = paced(box, _is_end, interval_tokens=100, interval_ms=60_000)
        box.put(StreamChunk([1], "a"))
        await gen.__anext__()
        task = asyncio.ensure_future(gen.__anext__())
        box.put(StreamChunk([2], "b"))          # held: the reader waits on its interval timer now
        await asyncio.sleep(0)                  # let the task reach its wait (one loop iteration)
        await asyncio.sleep(0)
        if woken:                               # the wake-up has run and the wait ended when the cancel comes
            box.put(StreamChunk([3], "c"))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_the_wake_rule_wakes_for_what_is_sent():
    unary, stream = wake_rule(True, 4), wake_rule(False, 4)
    assert [unary(StreamChunk([1], "a")), unary(StreamChunk([], "")), unary(StreamChunk([2], "b", "stop")),
            unary(Ended())] == [False, False, True, True]
    sizes = [0, 1, 1, 2, 1, 3, 1, 1, 2]            # tokens a step; wakes: the first with tokens, then at >= 4 since
    assert [stream(StreamChunk([7] * n, "x")) for n in sizes] == \
        [False, True, False, False, True, False, True, False, False]
    assert stream(StreamChunk([], "", "length")) and stream(Ended())


def test_a_slow_stream_is_woken_once_its_interval_ms_has_passed():
    now = [0.0]
    stream = wake_rule(False, 16, interval_ms=250, clock=lambda: now[0])
    woken = []
    for t in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6):     # a token every 100 ms: far fewer than 16 in 250 ms
        now[0] = t
        woken.append(stream(StreamChunk([1], "x")))
    assert woken == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("whole,wake_on,sent,wakeups", [
    (True, True, [40], 1),                          # a unary call: its loop is woken once, for the last item
    (True, False, [40], 40),                        # ... where a wake-up a step woke it 40 times
    (False, True, [1, 16, 16, 7], 4),               # a stream (interval 16): woken for what it sends
    (False, False, [1, 16, 16, 7], 40),
])
def test_a_box_wakes_its_loop_for_what_is_sent_not_every_step(whole, wake_on, sent, wakeups):
    """40 steps of one token each, the reader running between steps: the chunks sent are the same either way."""
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        _count_wake_ups(loop, calls)
        delivery = StepDelivery()
        box = ChunkBox(loop, delivery, wake_on=wake_rule(whole, 16) if wake_on else None)
        reader = asyncio.ensure_future(_collect(box, whole=whole, interval_tokens=16))

        def step(i):                                  # the step thread: one chunk a step, then the delivery
            box.put(StreamChunk([i], str(i), "length" if i == 39 else None))
            if i == 39:
                box.put(Ended())
            delivery.deliver()

        for i in range(40):
            _on_a_thread(step, i)
            for _ in range(3):                        # the reader takes what woke it before the next step
                await asyncio.sleep(0)
        return await reader

    chunks = asyncio.run(main())
    assert [len(c.token_ids) for c in chunks] == sent
    assert [t for c in chunks for t in c.token_ids] == list(range(40)) and chunks[-1].finish_reason == "length"
    assert len(calls) == wakeups


@pytest.mark.parametrize("tokens,first,elapsed_s,expected", [
    (1, True, 0.0, True), (0, True, 9.0, False),              # the first tokens never wait; no tokens: nothing to send
    (3, False, 0.0, False), (4, False, 0.0, True),            # interval_tokens = 4
    (1, False, 0.049, False), (1, False, 0.05, True),         # interval_ms = 50
])
def test_due_is_the_one_rule_both_sides_apply(tokens, first, elapsed_s, expected):
    assert due(tokens, first, elapsed_s, 4, 50.0) is expected
    assert due(tokens, first, 1e9, 4, None) is (tokens > 0 if first else tokens >= 4)     # no time limit
