"""The demo's loop detector on literal token lists."""
from cluster.bench.measure import has_loop


def test_loop_is_a_4gram_three_times():
    assert has_loop([1, 2, 3, 4] * 3)
    assert not has_loop([1, 2, 3, 4] * 2 + [1, 2, 3])          # twice and a prefix: no loop
    assert has_loop([7, 7, 7, 7, 7, 7])                        # overlapping occurrences count
    assert not has_loop([7, 7, 7, 7, 7])
    assert not has_loop(list(range(100)))
    assert not has_loop([])


def test_loop_parameters():
    seq = [5, 6, 9, 5, 6, 8, 5, 6]
    assert has_loop(seq, n=2, times=3)
    assert not has_loop(seq, n=2, times=4)
    assert not has_loop(seq, n=3, times=2)
