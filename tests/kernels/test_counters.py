"""The selection kernels' counter arena (``streamgr.kernels.counters``): eager calls get fresh
zeros, a sized arena hands out aligned slices in call order on every entry, a call past it gets
fresh zeros again, and the arena is the capturing thread's alone."""

from __future__ import annotations

import threading

import torch

from streamgr.kernels.counters import ALIGN, Counters, zeroed


def test_eager_calls_get_fresh_zeros():
    a = zeroed((2, 3), "cpu")
    a += 5
    b = zeroed((2, 3), "cpu")
    assert b.dtype == torch.int64 and b.shape == (2, 3) and int(b.count_nonzero()) == 0


def test_sized_slices_in_call_order_on_every_entry():
    c = Counters()
    with c.sizing():
        first = zeroed((3, 2), "cpu")
        zeroed((5,), "cpu")
    assert int(first.count_nonzero()) == 0
    assert c.need == 8 + 8  # 6 and 5 words, each slice rounded up to ALIGN (4)
    c.allocate("cpu")
    for _ in range(2):
        with c.serving():
            x = zeroed((3, 2), "cpu")
            y = zeroed((5,), "cpu")
        # views of the one buffer, at the same places on each entry (a graph's addresses)
        assert x.data_ptr() == c.buf.data_ptr()
        assert y.data_ptr() == c.buf.data_ptr() + 8 * 8
        assert x.shape == (3, 2) and y.shape == (5,)
    x[0, 0] = 7  # a kernel's write lands in the arena
    assert int(c.buf[0]) == 7
    assert c.overflow == 0


def test_a_call_past_the_sized_words_gets_its_own_zeros():
    c = Counters()
    with c.sizing():
        zeroed((4,), "cpu")
    c.allocate("cpu")
    c.buf.fill_(9)  # a slice of the arena would show it
    with c.serving():
        zeroed((4,), "cpu")
        extra = zeroed((4,), "cpu")
    assert int(extra.count_nonzero()) == 0 and extra.data_ptr() != c.buf.data_ptr()
    assert c.overflow == 1


def test_outside_the_context_and_on_other_threads_calls_are_eager():
    c = Counters()
    with c.sizing():
        zeroed((ALIGN,), "cpu")
    c.allocate("cpu")
    seen = []
    with c.serving():
        t = threading.Thread(target=lambda: seen.append(zeroed((ALIGN,), "cpu").data_ptr()))
        t.start()
        t.join()
    after = zeroed((ALIGN,), "cpu")
    assert seen[0] != c.buf.data_ptr() and after.data_ptr() != c.buf.data_ptr()
    assert c.overflow == 0  # neither call was the arena's
