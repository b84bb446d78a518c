"""Property-based fuzzing of the public API (hypothesis): bad arguments, random shapes, dtypes, strides,
special values (NaN, ±inf, −0.0, subnormals), damaged files. Each case ends in a clear error naming the
argument (ValueError/TypeError) or the reference result (float64 within a tolerance, or bit-exact).

The specs live in ``tests/fuzz_specs_*.py`` (every such file's ``SPECS`` is collected); how to add a technique
is at the top of ``tests/fuzz_registry.py``. CI runs a bounded, derandomized profile (same examples every run);
``THRIFTY_FUZZ_EXAMPLES=500`` runs that many per spec, slow ones included (e.g. before a release), ``THRIFTY_FUZZ_RANDOM=1`` draws new ones.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("hypothesis")  # pinned in requirements.txt; the GPU box may lack it (scripts/fetch_wheels.sh)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_registry import ArgSpec, FileSpec, NumericSpec  # noqa: E402

EXAMPLES = int(os.environ.get("THRIFTY_FUZZ_EXAMPLES", "25"))
settings.register_profile(
    "thrifty-ci", max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("THRIFTY_FUZZ_RANDOM"),
    database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
FUZZ = settings.get_profile("thrifty-ci")


def _collect_specs() -> list:
    specs = []
    for f in sorted(Path(__file__).parent.glob("fuzz_specs_*.py")):
        specs += importlib.import_module(f.stem).SPECS
    return specs


SPECS = _collect_specs()


def _of(kind):
    return [pytest.param(s, id=s.name) for s in SPECS if isinstance(s, kind)]


def _examples(spec) -> int:
    return min(spec.max_examples, EXAMPLES) if spec.max_examples and "THRIFTY_FUZZ_EXAMPLES" not in os.environ \
        else EXAMPLES


# ------------------------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("spec", _of(ArgSpec))
def test_bad_arguments_raise_clear_errors(spec: ArgSpec):
    spec.call(**spec.valid())  # the baseline call works
    for arg, values in spec.bad.items():
        for value in values:
            with pytest.raises((ValueError, TypeError)) as info:
                spec.call(**{**spec.valid(), arg: value})
            want = spec.mention.get(arg, arg)
            assert want in str(info.value), f"{spec.name}({arg}={value!r}): message {str(info.value)!r} " \
                                            f"does not name {want!r}"


# ------------------------------------------------------------------------------------- numeric: reference
@pytest.mark.parametrize("spec", _of(NumericSpec))
def test_numeric_matches_reference(spec: NumericSpec):
    @settings(FUZZ, max_examples=_examples(spec))
    @given(spec.inputs)
    def run(inputs):
        spec.check(inputs, spec.run(inputs))

    run()


# ------------------------------------------------------------------------------------------------- files
def _write(spec, obj, root: Path) -> Path:
    path = root / "obj"
    spec.write(obj, path)
    return path


def _files(path: Path) -> list:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


@pytest.mark.parametrize("spec", _of(FileSpec))
def test_file_round_trip(spec: FileSpec, tmp_path_factory):
    @settings(FUZZ, max_examples=_examples(spec))
    @given(spec.objects)
    def run(obj):
        path = _write(spec, obj, tmp_path_factory.mktemp("rt"))
        assert spec.same(obj, spec.read(path))

    run()


DAMAGE = st.sampled_from(["truncate", "flip", "append", "zero-run", "empty"])


@pytest.mark.parametrize("spec", _of(FileSpec))
def test_damaged_file_is_refused_or_read_unchanged(spec: FileSpec, tmp_path_factory):
    @settings(FUZZ, max_examples=_examples(spec))
    @given(spec.objects, st.data())
    def run(obj, data):
        path = _write(spec, obj, tmp_path_factory.mktemp("damage"))
        target = data.draw(st.sampled_from(spec.targets(path) if spec.targets else _files(path)), label="file")
        raw = bytearray(target.read_bytes())
        how = data.draw(DAMAGE, label="damage")
        n = len(raw)
        if how == "truncate" and n:
            raw = raw[: data.draw(st.integers(0, n - 1), label="keep")]
        elif how == "flip" and n:
            i = data.draw(st.integers(0, n - 1), label="at")
            raw[i] ^= data.draw(st.integers(1, 255), label="xor")
        elif how == "append":
            raw += bytes(data.draw(st.binary(min_size=1, max_size=64), label="garbage"))
        elif how == "zero-run" and n:
            i = data.draw(st.integers(0, n - 1), label="at")
            raw[i: i + data.draw(st.integers(1, 64), label="len")] = bytes(min(64, n - i))[: max(0, n - i)]
        elif how == "empty":
            raw = bytearray()
        target.write_bytes(bytes(raw))
        try:
            back = spec.read(path)
        except spec.errors as err:
            assert str(target.name) in str(err) or str(path.name) in str(err), \
                f"the error does not name the file: {err}"
            return
        assert spec.same(obj, back), f"{how} of {target.name} was read as different content"

    run()


# ------------------------------------------------------------------------------------------- shared checks
@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(-10, 10), st.floats(0, 10),
       st.booleans(), st.booleans())
@FUZZ
def test_check_range_accepts_exactly_the_finite_values_in_range(x, lo, width, lo_open, hi_open):
    from thrifty._checks import check_range

    hi = lo + width
    inside = math.isfinite(x) and (lo < x if lo_open else lo <= x) and (x < hi if hi_open else x <= hi)
    if inside:
        assert check_range("arg", x, lo, hi, lo_open=lo_open, hi_open=hi_open) == x
    else:
        with pytest.raises(ValueError, match="arg"):
            check_range("arg", x, lo, hi, lo_open=lo_open, hi_open=hi_open)


@given(st.one_of(st.floats(), st.integers(), st.booleans(), st.none(), st.text(max_size=3)))
@FUZZ
def test_check_finite(x):
    from thrifty._checks import check_finite

    ok = not isinstance(x, (bool, str, type(None))) and math.isfinite(x)
    if ok:
        assert check_finite("arg", x) == x
    else:
        with pytest.raises((ValueError, TypeError), match="arg"):
            check_finite("arg", x)


def test_every_spec_kind_is_collected():
    names = {s.name for s in SPECS}
    assert {"attention.reference", "loss.linear_cross_entropy", "neuzip.file", "train.checkpoint"} <= names
    assert all(isinstance(s, (ArgSpec, NumericSpec, FileSpec)) for s in SPECS) and torch.__version__
