"""thrifty.bench on CPU: result schema round trip, plot, table, timer, CUDA-graph capture, argument errors."""

import json
import time

import pytest
import torch

from thrifty import bench

from fake_triton import FakeJit, allow_direct_launches

ROWS = [
    {"backend": "a", "S": 1024, "rate": 10.0},
    {"backend": "b", "S": 1024, "rate": 12.5},
    {"backend": "a", "S": 2048, "rate": 11.0},
    {"backend": "b", "S": 2048, "error": "RuntimeError: unsupported"},  # error rows are kept, not plotted
]


def test_write_read_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("THRIFTY_COMMIT", "deadbeef")  # used only where no .git is found
    summary = {"x_tflops": 12.5, "nan_becomes_null": float("nan"), "tensor": torch.tensor(3.0)}
    path = bench.write_result("unit", ROWS, summary, device="cpu", extra={"note": "hi"}, results_dir=tmp_path)
    assert path == tmp_path / "unit_cpu.json"
    doc = bench.read_result(path)
    for key in bench.REQUIRED_KEYS:
        assert key in doc
    assert doc["schema"] == bench.SCHEMA_VERSION and doc["name"] == "unit" and doc["device"] == "cpu"
    assert doc["rows"] == ROWS
    assert doc["summary"] == {"x_tflops": 12.5, "nan_becomes_null": None, "tensor": 3.0}
    assert doc["extra"] == {"note": "hi"}
    for key in ("date", "commit", "python", "torch", "triton", "transformers", "gpu", "device"):
        assert key in doc["meta"]
    assert doc["meta"]["commit"]  # git HEAD here, or $THRIFTY_COMMIT without a checkout
    json.loads(path.read_text())  # strict JSON, no NaN literals


def test_write_result_with_plot(tmp_path):
    path = bench.write_result("plotted", ROWS, {}, device="cpu", results_dir=tmp_path,
                              plot=dict(x="S", y="rate", hue="backend", title="t"))
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind,logy", [("bar", False), ("line", True)])
def test_plot_rows(tmp_path, kind, logy):
    out = bench.plot_rows(ROWS, x="S", y="rate", hue="backend", path=tmp_path / "p.png", kind=kind, logy=logy)
    assert out.stat().st_size > 1000


def test_read_result_rejects_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"rows": []}')
    with pytest.raises(ValueError, match="missing keys"):
        bench.read_result(p)


def test_format_table_aligned():
    text = bench.print_table(ROWS, ["backend", "S", "rate", "error"], max_width=12)
    lines = text.splitlines()
    assert lines[0].split() == ["backend", "S", "rate", "error"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert "RuntimeEr..." in text and "-" in lines[2]  # cut long cells; missing values print as "-"
    end = lines[0].index("rate") + len("rate")
    assert lines[2][:end].endswith(" 10") and lines[3][:end].endswith("12.5")  # numbers right-aligned


def test_time_fn_cpu_cycles_inputs():
    seen = []
    sets = [(torch.full((4,), float(i)),) for i in range(3)]
    t = bench.time_fn(lambda x: seen.append(int(x[0])), sets, warmup=1, reps=7, device="cpu")
    assert t.backend == "perf_counter" and t.reps == 7
    assert seen == [0] + [i % 3 for i in range(7)]  # warm-up, then the timed calls rotate over the sets
    assert t.median_ms >= 0 and t.min_ms <= t.median_ms and t.spread_pct >= 0
    assert t.rate(1e9, 1e9) > 0


def test_time_fn_factory_and_budget():
    made = []
    t = bench.time_fn(lambda a, b: torch.mm(a, b), lambda: made.append(1) or (torch.randn(32, 32), torch.randn(32, 32)),
                      n_inputs=3, warmup=1, reps=1000, min_reps=4, budget_s=1e-6, device="cpu")
    assert len(made) == 3
    assert t.reps == 4  # the budget cut 1000 reps down to min_reps


def test_time_fn_no_inputs():
    calls = []
    t = bench.time_fn(lambda: calls.append(1), warmup=0, reps=2, device="cpu")
    assert t.reps == 2 and len(calls) == 2


def test_peak_memory_cpu_is_none():
    assert bench.peak_memory(lambda: torch.ones(3), device="cpu") is None


@pytest.mark.cuda
def test_time_fn_cuda_and_peak_memory():
    x = torch.randn(1024, 1024, device="cuda")
    t = bench.time_fn(lambda a: a @ a, [(x,)], warmup=2, reps=5, flush_l2=True)
    assert t.backend == "cuda-events" and t.median_ms > 0
    peak = bench.peak_memory(lambda a: a @ a, x)
    assert peak >= 4 * 1024 * 1024


def test_detect_device_cpu():
    assert bench.detect_device("cpu") == "cpu"


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: bench.time_fn(42), TypeError, "fn: expected a callable"),
        (lambda: bench.time_fn(print, [], device="cpu"), ValueError, "at least one input set"),
        (lambda: bench.time_fn(print, "abc", device="cpu"), TypeError, "inputs"),
        (lambda: bench.time_fn(print, reps=0, device="cpu"), ValueError, "reps"),
        (lambda: bench.time_fn(print, warmup=-1, device="cpu"), ValueError, "warmup"),
        (lambda: bench.time_fn(print, budget_s=0, device="cpu"), ValueError, "budget_s"),
        (lambda: bench.time_fn(print, gpu_only="yes", device="cpu"), TypeError, "gpu_only"),
        (lambda: bench.time_fn(print, flush_l2=1, device="cpu"), TypeError, "flush_l2"),
        (lambda: bench.write_result("bad name", [], {}, device="cpu"), ValueError, "name"),
        (lambda: bench.write_result("ok", {"a": 1}, {}, device="cpu"), TypeError, "rows"),
        (lambda: bench.write_result("ok", [1], {}, device="cpu"), TypeError, r"rows\[0\]"),
        (lambda: bench.write_result("ok", [], [], device="cpu"), TypeError, "summary"),
        (lambda: bench.write_result("ok", [], {}, device="../x"), ValueError, "device"),
        (lambda: bench.plot_rows(ROWS, x="S", y="rate", path="p.png", kind="pie"), ValueError, "kind"),
        (lambda: bench.plot_rows(ROWS, x="S", y="nope", path="p.png"), ValueError, "no row"),
        (lambda: bench.format_table(ROWS, "backend"), TypeError, "columns"),
    ],
)
def test_argument_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.cuda
def test_cuda_gpu_only_timing_hides_host_overhead():
    """A call that spends 300 µs on the host before a tiny kernel: plain event timing sees the host time,
    gpu_only (a spin kernel ahead of each call) sees the kernel."""
    import time as _time

    from thrifty.bench import time_fn
    x = torch.zeros(1024, device="cuda")

    def slow_host():
        _time.sleep(3e-4)
        x.add_(1)

    plain = time_fn(slow_host, warmup=2, reps=20)
    gpu = time_fn(slow_host, warmup=2, reps=20, gpu_only=True)
    assert plain.median_ms > 0.25
    assert gpu.median_ms < 0.1 and gpu.backend == "cuda-events, gpu-only"


def test_capture_graph_argument_errors():
    with pytest.raises(TypeError, match="fn must be callable"):
        bench.capture_graph(torch.zeros(1))
    with pytest.raises(TypeError, match="warmup"):
        bench.capture_graph(lambda: None, warmup=1.5)
    with pytest.raises(ValueError, match="warmup"):
        bench.capture_graph(lambda: None, warmup=-1)
    with pytest.raises(ValueError, match="repeat"):
        bench.capture_graph(lambda: None, repeat=0)
    if not torch.cuda.is_available():
        calls = []
        with pytest.raises(RuntimeError, match="capture_graph: CUDA graphs need a CUDA device"):
            bench.capture_graph(lambda: calls.append(1))
        assert not calls  # checked before any warm-up call


@pytest.mark.cuda
def test_cuda_capture_graph_replays():
    """Warm-up calls run eagerly, the capture does not run ``fn``, each replay runs the ``repeat`` captured calls
    and writes the returned (pool) tensor in place."""
    x = torch.zeros(4, device="cuda")

    def step():
        x.add_(1)
        return x * 2

    graph, out = bench.capture_graph(step, warmup=2, repeat=3)
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4  # the 2 warm-up calls; the capture ran nothing
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [8.0] * 4 and out.tolist() == [16.0] * 4


# ------------------------------------------------------------------------------------------ instrumentation
def test_count_launches_counts_each_launch_once_and_restores(monkeypatch):
    """Triton's path and the direct path (a keyed launch whose first call goes through __call__) count once per
    launch; ``around`` wraps each; the launch methods are the class's own again afterwards."""
    import contextlib

    from thrifty.triton_utils import FastLauncher

    triton_path, direct = FastLauncher(FakeJit(["x", "BLOCK"])), FastLauncher(FakeJit(["x", "BLOCK"]))
    triton_path.interpreted = True  # the interpreter's (Triton's own) path: fn[grid](...) every time
    direct.interpreted = False
    allow_direct_launches(monkeypatch, stream=0)
    seen = []

    @contextlib.contextmanager
    def around(name):
        seen.append(("enter", name))
        yield
        seen.append(("exit", name))

    real = (FastLauncher.__call__, FastLauncher.keyed)
    x = torch.empty(4)
    with bench.count_launches(around) as counts:
        triton_path((1,), x, BLOCK=4, num_warps=1, num_stages=1)
        for _ in range(3):  # a miss (through __call__, Triton's path), then two direct launches
            direct.keyed(("sig",), (1,), x, BLOCK=4, num_warps=1, num_stages=1)
    assert counts == {"_fake_kernel": 4}
    assert seen == [("enter", "_fake_kernel"), ("exit", "_fake_kernel")] * 4
    assert direct.fn.compiles == 1 and len(direct.fn.kernel.runs) == 2 and triton_path.fn.compiles == 1
    assert (FastLauncher.__call__, FastLauncher.keyed) == real
    triton_path((1,), x, BLOCK=4, num_warps=1, num_stages=1)
    assert counts == {"_fake_kernel": 4} and len(seen) == 8  # outside the block: not counted
    with bench.count_launches() as plain:  # without ``around``
        triton_path((1,), x, BLOCK=4, num_warps=1, num_stages=1)
    assert plain == {"_fake_kernel": 1}
    with pytest.raises(TypeError, match="around must be callable"):
        with bench.count_launches("no"):
            pass


def test_count_launches_sees_a_thrifty_kernel():
    """A real launcher of the library (the KV family's append kernel, interpreter or not): its name is counted."""
    from thrifty.kv import quantize_kv_cache
    from thrifty.kv.decode_kernel import append_triton
    from thrifty.triton_utils import kernels_available

    if not kernels_available("cpu"):
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it on a CPU machine)")
    k = torch.randn(1, 2, 8, 16)
    cache = quantize_kv_cache(k, k, capacity=16)
    with bench.count_launches() as counts:
        append_triton(cache, k[:, :, :1], k[:, :, :1])
    assert sum(counts.values()) >= 1 and all(name.endswith("_kernel") for name in counts), counts


def test_stubbed_launches_runs_the_host_path_without_kernels_and_restores():
    """Inside the block thrifty's launchers take their direct path on a stand-in driver (no kernel runs) and the
    dispatch's kernels_available says yes for any device; afterwards every launcher and name is as before."""
    import importlib

    from thrifty import triton_utils
    from thrifty.kv import decode_attention, quantize_kv_cache
    from thrifty.kv import decode_kernel
    from thrifty.triton_utils import FastLauncher

    kv_decode = importlib.import_module("thrifty.kv.decode")
    launchers = [v for v in vars(decode_kernel).values() if isinstance(v, FastLauncher)]
    before = [(lz.fn, lz.interpreted, dict(lz.cache)) for lz in launchers]
    names = (triton_utils._DRIVER, triton_utils._direct_launch_allowed, kv_decode.kernels_available)
    k = torch.randn(1, 2, 8, 64)  # head_dim 64: one the decode kernel takes
    cache = quantize_kv_cache(k, k, capacity=16)
    q = torch.randn(1, 4, 1, 64)
    with bench.stubbed_launches() as n:
        assert n >= len(launchers) > 0
        assert kv_decode.kernels_available("meta") and triton_utils.kernels_available("meta")
        out = decode_attention(q, cache, impl="triton")  # the host path only: out is never written
        assert out.shape == q.shape
        assert any(lz.cache for lz in launchers)  # the direct path ran (keys cached) ...
        assert all(not lz.interpreted for lz in launchers)
    assert [(lz.fn, lz.interpreted, dict(lz.cache)) for lz in launchers] == before  # ... and is undone
    assert (triton_utils._DRIVER, triton_utils._direct_launch_allowed, kv_decode.kernels_available) == names
    assert not triton_utils.kernels_available("meta")


def test_host_us_per_call_counts_warmup_and_best_of_repeats():
    """Host time per call: warm-up calls untimed, then ``repeats`` runs of ``calls`` back-to-back calls, the best
    run's mean (a shared machine's noise only adds). Bad arguments are refused naming them."""
    seen = []
    us = bench.host_us_per_call(lambda: seen.append(1), calls=7, warmup=3, repeats=2, device="cpu")
    assert len(seen) == 3 + 2 * 7
    assert 0 < us < 1e4
    slow_first = iter([0.002] * 5 + [0.0] * 5)
    t = bench.host_us_per_call(lambda: time.sleep(next(slow_first)), calls=5, warmup=0, repeats=2, device="cpu")
    assert t < 1000  # the second, fast run: ~0 µs, not the first's ~2000 µs per call
    for bad in (dict(calls=0), dict(warmup=-1), dict(repeats=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            bench.host_us_per_call(lambda: None, device="cpu", **bad)
    with pytest.raises(TypeError, match="fn"):
        bench.host_us_per_call(None)
