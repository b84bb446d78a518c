"""The top-level API: one import, lazy submodules, clear error for unknown names."""

import pytest

import thrifty


def test_top_level_names_resolve():
    for name in thrifty.__all__:
        assert getattr(thrifty, name) is not None


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        thrifty.no_such_thing
