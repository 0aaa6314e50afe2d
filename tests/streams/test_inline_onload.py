"""The inline onload (``STREAMGR_ONLOAD_INLINE=1``, CUDA's default for a page-locked host
store; forced here on the CPU, where copies are synchronous): a host hit's copies issued from
the batch's own thread, ``INLINE_AHEAD`` layers ahead of the layer the model waits for, after
the batch's own uploads; an abandoned one issues nothing more; answers stay recompute's."""

from __future__ import annotations

import pytest

from streamgr.streams import OnloadFault
from streamgr.streams.onload import INLINE_AHEAD, onload_inline
from tests.cache.helpers import runners
from tests.streams.test_threaded_transfers import force_direct, serve_equal_to_recompute

LAYERS = 5


def _pipeline():
    engines = runners(page_tokens=4, chunk_tokens=8, device_pages=24, host_chunks=64,
                      model={"num_layers": LAYERS})
    runner = engines["hierarchical"].runner
    onload = force_direct(runner)
    assert onload.deferred
    landed = []
    land = onload._layer_landed
    onload._layer_landed = lambda layer, *a: (landed.append(layer), land(layer, *a))[1]
    return engines, runner, onload, landed


def _job(runner, chunks=(0, 1)):
    per = runner.stores.chunk_pages
    return [("u", list(chunks), list(range(len(chunks) * per)))]


def test_inline_onload_issues_layers_as_the_model_reaches_them():
    _, runner, onload, landed = _pipeline()
    handles = onload.submit(_job(runner))
    issued = lambda: [e.is_set() for e in handles.issued]  # noqa: E731
    assert handles.pump is not None
    assert landed == list(range(INLINE_AHEAD + 1))  # layer 0 and the ones ahead of it
    assert issued() == [l <= INLINE_AHEAD for l in range(LAYERS)]
    handles.wait(1)
    assert issued() == [l <= 1 + INLINE_AHEAD for l in range(LAYERS)]
    handles.wait(0)  # an earlier layer again: nothing more, nothing twice
    assert landed == list(range(2 + INLINE_AHEAD))
    handles.done()  # the rest, in order, each once
    assert landed == list(range(LAYERS)) and all(issued())
    host = runner.stores.host
    assert onload.bytes == 2 * LAYERS * host[0, 0].numel() * host.element_size()


def test_an_abandoned_inline_onload_issues_nothing_more():
    """A batch that fails before its last layers (``_quiesce`` settles its handles): no more
    copies go out, the handles read failed, and the next onload runs whole."""
    _, runner, onload, landed = _pipeline()
    handles = onload.submit(_job(runner))
    assert handles.settle()
    assert landed == list(range(INLINE_AHEAD + 1)) and handles.error is not None
    with pytest.raises(OnloadFault):
        handles.wait(LAYERS - 1)
    assert landed == list(range(INLINE_AHEAD + 1))
    again = onload.submit(_job(runner, (2,)))
    again.done()
    assert landed[INLINE_AHEAD + 1:] == list(range(LAYERS)) and again.error is None


def test_a_failed_inline_onload_raises_at_the_models_wait():
    _, runner, onload, landed = _pipeline()
    onload.fail_next = True
    handles = onload.submit(_job(runner))
    assert landed == [] and all(e.is_set() for e in handles.issued)
    with pytest.raises(OnloadFault, match="injected"):
        handles.wait(0)


@pytest.mark.parametrize("early", [False, True])
def test_a_host_hit_batch_queues_its_uploads_before_its_onload(early):
    """The batch's own host-to-device copies (rows, append slots, attention plans) share the
    copy engine with the onload in issue order: they go first, so the model's first layer
    never waits behind the history's copies. ``early_onload`` (an A/B of
    tools/probe_hosthit.py): the onload submitted right after the split instead, its first
    layers ahead of the uploads. Answers equal recompute's either way."""
    engines, runner, onload, _ = _pipeline()
    runner.early_onload = early
    order = []
    upload, begin = runner._upload, onload._begin
    runner._upload = lambda *a: (order.append("upload"), upload(*a))[1]
    onload._begin = lambda *a: (order.append("onload"), begin(*a))[1]
    serve_equal_to_recompute(engines, steps=40)
    assert "onload" in order and runner.bytes_onloaded > 0
    for i, what in enumerate(order):
        if what == "onload":
            assert order[i + (1 if early else -1)] == "upload"


def test_inline_knob_says_what_it_expects(monkeypatch):
    from streamgr.errors import StreamgrError
    for bad in ("yes", "2", ""):
        monkeypatch.setenv("STREAMGR_ONLOAD_INLINE", bad)
        with pytest.raises(StreamgrError, match="STREAMGR_ONLOAD_INLINE"):
            onload_inline()
    monkeypatch.setenv("STREAMGR_ONLOAD_INLINE", "0")
    assert onload_inline() is False
    monkeypatch.delenv("STREAMGR_ONLOAD_INLINE")
    assert onload_inline() is True
    _, _, onload, _ = _pipeline()
    onload.inline = False
    assert not onload.deferred
