"""thrifty._graphs: captures run with Python's cyclic garbage collector paused, so a collection cannot destroy an
unreachable CUDA graph in the middle of a capture (the driver refuses that and invalidates the capture)."""

import gc

import pytest
import torch

from thrifty import bench


def _cyclic_garbage(n):
    for _ in range(n):
        cycle = []
        cycle.append(cycle)


def test_gc_paused_stops_automatic_collections_and_restores_the_state():
    from thrifty._graphs import gc_paused

    started = []
    callback = lambda phase, info: phase == "start" and started.append(info["generation"])  # noqa: E731
    gc.callbacks.append(callback)
    try:
        assert gc.isenabled()
        with gc_paused():
            _cyclic_garbage(20 * gc.get_threshold()[0])
            assert not gc.isenabled() and not started
        assert gc.isenabled()
        _cyclic_garbage(2 * gc.get_threshold()[0])
        assert started  # collections run again
        gc.disable()
        with pytest.raises(KeyError):
            with gc_paused():
                raise KeyError("inside")
        assert not gc.isenabled()  # a disabled collector stays disabled
    finally:
        gc.enable()
        gc.callbacks.remove(callback)


def make_unreachable_graph_garbage(holder: list) -> None:
    """Drops the graph in ``holder`` into a reference cycle (only the cyclic collector frees it), then allocates
    enough containers that an enabled collector would start a collection here."""
    cycle = [holder.pop()]
    cycle.append(cycle)
    del cycle
    _cyclic_garbage(5 * gc.get_threshold()[0])


@pytest.mark.cuda
def test_a_graph_in_a_reference_cycle_does_not_break_a_later_capture():
    x = torch.zeros(4, device="cuda")
    old = [bench.capture_graph(lambda: x + 1, warmup=1)[0]]

    def step():
        if torch.cuda.is_current_stream_capturing() and old:
            make_unreachable_graph_garbage(old)
        return x * 2 + 1

    graph, out = bench.capture_graph(step, warmup=1)
    assert not old  # the garbage was made inside the capture
    gc.collect()  # the old graph is freed now, outside any capture
    x.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [7.0] * 4
    assert torch.randn(2, device="cuda").isfinite().all()  # the CUDA RNG is not left in graph mode
