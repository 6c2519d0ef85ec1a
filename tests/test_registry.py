"""The one registry helper: names, the one-line error, and one plugin per name."""

import pytest

from kilolayer.errors import ConfigError
from kilolayer.registry import Registry


def test_register_get_and_the_one_line_error():
    reg = Registry("model.scheme", "residual scheme")

    @reg.register()
    class B:
        name = "b"

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a and reg["b"] is B and sorted(reg) == ["a", "b"] and "a" in reg and len(reg) == 2
    with pytest.raises(ConfigError) as e:
        reg.get("c")
    assert str(e.value) == "model.scheme='c': unknown residual scheme; allowed: a, b"
    assert "\n" not in str(e.value)
    assert reg.unknown("c", field="objective.options.decoder_scheme").startswith("objective.options.decoder_scheme='c'")
    with pytest.raises(ConfigError, match=r"model.scheme=\['x'\]"):
        reg.get(["x"])  # an unhashable value from a YAML file is still a one-line error


def test_a_name_holds_one_plugin():
    reg = Registry("data.name", "data source")
    reg.add("x", len)
    reg.add("x", len)  # the same object again (a module imported twice) is fine
    with pytest.raises(ValueError, match="'x' is already registered to builtins.len"):
        reg.add("x", abs)
    with pytest.raises(TypeError, match="needs a name"):
        reg.register()(object())


def test_added_registers_for_a_block_only():
    reg = Registry("study.findings", "finding")
    reg.add("kept", len)
    with reg.added("mine", abs) as fn:
        assert fn is abs and reg.get("mine") is abs
    assert reg.names() == ["kept"]
    with pytest.raises(ValueError, match="'kept' is already registered"), reg.added("kept", len):
        pass
    assert reg.names() == ["kept"]
