"""The onload/offload pipelines on their threads, on the CPU (STREAMGR_THREADED_TRANSFERS=1: the
path CUDA takes, with streams and events as no-ops): cached scores still equal recompute's,
transfers really ran on the pipelines' threads, and an injected onload fault still falls back.
Also ``streams.off_stream`` on the CPU (the builds of live updates): just the call."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import torch

from tests.cache.helpers import run_batch, runners
from tests.cache.test_pipeline_faults import workload


def test_threaded_pipelines_on_the_cpu_keep_answers_equal(monkeypatch):
    monkeypatch.setenv("STREAMGR_THREADED_TRANSFERS", "1")
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=24, host_chunks=64)
    runner = engines["hierarchical"].runner
    assert runner.onload.threaded and runner.offload.threaded
    seen: set[str] = set()
    transfer = runner.onload._transfer

    def spy(*a, **kw):  # which thread moved the bytes
        seen.add(threading.current_thread().name)
        return transfer(*a, **kw)
    runner.onload._transfer = spy
    rng = np.random.default_rng(1)
    faults = 0
    for i, batch in enumerate(workload(rng, engines, steps=40)):
        if i == 25:
            runner.onload.fail_next = True
        ref = run_batch(engines["recompute"], batch)
        got = run_batch(engines["hierarchical"], batch)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g[0], r[0], rtol=2e-4, atol=2e-5)
        faults = runner.onload_faults
    assert runner.bytes_onloaded > 0 and runner.manager.counters["offloaded_chunks"] > 0
    assert seen and all(n.startswith("streamgr-onload") for n in seen), seen
    assert faults >= 1
    runner.manager.check_invariants()
    for e in engines.values():
        e.close_offline()


def test_inline_is_the_cpu_default(monkeypatch):
    monkeypatch.delenv("STREAMGR_THREADED_TRANSFERS", raising=False)
    runner = runners(page_tokens=4, chunk_tokens=8, device_pages=24, host_chunks=64)[
        "hierarchical"].runner
    assert not runner.onload.threaded and not runner.offload.threaded


def test_gpu_only_cache_has_null_transfers():
    """No host tier: the runner gets null pipelines (no threads), and serving still works."""
    from streamgr.streams import NullOffload, NullOnload
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=24, host_chunks=64)
    runner = engines["gpu-only"].runner
    assert isinstance(runner.onload, NullOnload) and isinstance(runner.offload, NullOffload)
    rng = np.random.default_rng(2)
    from_gpu = 0
    for batch in workload(rng, engines, steps=15):
        ref = run_batch(engines["recompute"], batch)
        got = run_batch(engines["gpu-only"], batch)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g[0], r[0], rtol=2e-4, atol=2e-5)
            from_gpu += g[1]["tokens_from_gpu"]
    assert from_gpu > 0  # the device cache served
    snap = runner.snapshot()
    assert snap["bytes_onloaded"] == snap["bytes_offloaded"] == snap["offloads_in_flight"] == 0
    engines["gpu-only"].close_offline()


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("group,layers", [(1, 2), (2, 2), (2, 3), (1, 3)])
def test_direct_onload_in_layer_groups_keeps_answers_equal(monkeypatch, group, layers, raw,
                                                           inline):
    """The page-locked store's direct DMA path (CUDA's; here forced on the CPU, where copies
    are synchronous): copying one layer of a chunk at a time (MTServe's order) or a group of
    layers per copy (``STREAMGR_ONLOAD_LAYERS``; a last group shorter when it does not divide
    the layers) gives the same answers as recompute, and each layer is signalled once. ``raw``:
    the copies on raw pointers (CUDA's ``cudaMemcpyAsync``; here a memmove at the same
    addresses), so the pointer arithmetic over chunks and layers is what is checked.
    ``inline``: issued from the batch's thread as the model reaches each layer (the default),
    or by the transfer code of the onload thread (``STREAMGR_ONLOAD_INLINE=0``)."""
    monkeypatch.setenv("STREAMGR_ONLOAD_LAYERS", str(group))
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=24, host_chunks=64,
                      model={"num_layers": layers})
    runner = engines["hierarchical"].runner
    onload = force_direct(runner)
    onload.inline = inline
    assert onload.layer_group == group and onload.deferred == inline
    calls, landed, paths = [], [], set()
    begin, land, direct = onload._begin, onload._layer_landed, onload._direct
    onload._begin = lambda *a: (lambda got: (calls.append(len(got[0])), got)[1])(begin(*a))
    onload._direct = lambda *a: (paths.add("thread"), direct(*a))[1]
    onload._layer_landed = lambda layer, *a: (landed.append(layer), land(layer, *a))[1]
    raw_calls = []
    if raw:
        def memmove(dst, src, n, stream):
            raw_calls.append(n)
            ctypes.memmove(dst, src, n)
        onload.raw_copy = memmove
    serve_equal_to_recompute(engines)
    layers = runner.stores.layers
    host = runner.stores.host
    layer_bytes = host[0, 0].numel() * host.element_size()
    assert calls and runner.bytes_onloaded == sum(calls) * layers * layer_bytes
    assert landed == list(range(layers)) * len(calls)  # every layer once per onload, in order
    assert paths == (set() if inline else {"thread"})
    assert sum(raw_calls) == (runner.bytes_onloaded if raw else 0)
    for e in engines.values():
        e.close_offline()


def force_direct(runner):
    """The runner's onload on the page-locked store's direct path (CUDA's), forced on the CPU
    (where copies are synchronous)."""
    onload = runner.onload
    onload._staging_buffers()  # made now, unpinned (the CPU has no pinned allocator)
    onload.pin = True  # the direct path: DMA straight from a page-locked store
    runner.stores.host.is_pinned = lambda: True
    return onload


def serve_equal_to_recompute(engines, steps: int = 30) -> None:
    rng = np.random.default_rng(3)
    for batch in workload(rng, engines, steps=steps):
        ref = run_batch(engines["recompute"], batch)
        got = run_batch(engines["hierarchical"], batch)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g[0], r[0], rtol=2e-4, atol=2e-5)


def test_a_failing_raw_copy_fails_one_onload_then_torch_copies_serve():
    """A raw ``cudaMemcpyAsync`` that fails (say, CuPy's runtime unusable with this driver):
    that batch's onload fails and its users are recomputed (answers still equal recompute's),
    the pipeline drops the raw copier with a warning, and later onloads copy through torch."""
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=24, host_chunks=64)
    runner = engines["hierarchical"].runner
    onload = force_direct(runner)
    tried = []

    def broken(dst, src, n, stream):
        tried.append(n)
        raise RuntimeError("cudaErrorInsufficientDriver")
    onload.raw_copy = broken
    serve_equal_to_recompute(engines)
    assert len(tried) == 1 and onload.raw_copy is None  # one failure, then torch's copies
    assert runner.onload_faults == 1 and runner.bytes_onloaded > 0
    for e in engines.values():
        e.close_offline()


def test_onload_layer_group_knob_says_what_it_expects(monkeypatch):
    from streamgr.errors import StreamgrError
    from streamgr.streams.onload import onload_layer_group
    for bad in ("0", "9", "two", "-1"):
        monkeypatch.setenv("STREAMGR_ONLOAD_LAYERS", bad)
        with pytest.raises(StreamgrError, match="STREAMGR_ONLOAD_LAYERS"):
            onload_layer_group(8)
    monkeypatch.setenv("STREAMGR_ONLOAD_LAYERS", "8")
    assert onload_layer_group(8) == 8


def test_onload_window_knob_says_what_it_expects(monkeypatch):
    from streamgr.errors import StreamgrError
    from streamgr.streams.onload import onload_window_bytes
    for bad in ("-1", "lots", "1.5"):
        monkeypatch.setenv("STREAMGR_ONLOAD_WINDOW_MB", bad)
        with pytest.raises(StreamgrError, match="STREAMGR_ONLOAD_WINDOW_MB"):
            onload_window_bytes()
    monkeypatch.setenv("STREAMGR_ONLOAD_WINDOW_MB", "0")
    assert onload_window_bytes() == 0
    monkeypatch.delenv("STREAMGR_ONLOAD_WINDOW_MB")
    assert onload_window_bytes() == 32 << 20


class _FakeEvent:
    """A copy-completion mark: landed once the issuing thread waited for it."""

    def __init__(self, log):
        self.log, self.upto = log, None

    def synchronize(self):
        self.log.append(("wait", self.upto))


def test_onload_window_keeps_the_bytes_in_flight_under_its_limit():
    """The pacing of a host hit's copies: before each copy, the bytes issued and not yet known
    landed stay within the window (it waits for the oldest marks, oldest first); copies that
    fit go out without waiting; a limit of 0 never waits."""
    from types import SimpleNamespace
    from streamgr.streams.onload import _Window
    log = []

    def record_event(event):
        log.append(("mark", None))
        return event

    streams = SimpleNamespace(onload=SimpleNamespace(record_event=record_event),
                              event=lambda: _FakeEvent(log))
    w = _Window(100, streams)
    sizes = [10, 30, 5, 40, 25, 25, 60, 7, 100, 3] * 3
    for n in sizes:
        w.before(n)
        assert w.issued + n - w.landed <= 100 or not w.marks  # within, or nothing left to wait
        w.after(n)
        if w.marks:
            w.marks[-1][0].upto = w.marks[-1][1]
    waits = [u for k, u in log if k == "wait"]
    assert waits == sorted(waits) and len(waits) > 5  # oldest first, and it did pace
    assert w.issued == sum(sizes)
    free = _Window(0, streams)
    log.clear()
    for n in sizes:
        free.before(n)
        free.after(n)
    assert log == []  # no marks, no waits


def test_off_stream_on_the_cpu_just_runs():
    from streamgr.streams import off_stream
    assert off_stream(torch.device("cpu"), lambda a, b: a + b, 2, 3) == 5
