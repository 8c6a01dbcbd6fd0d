"""Registry: names to entries, clear errors for unknown or taken names."""
import pytest

from headscope.registry import Registry


def test_register_lookup_and_iterate_like_a_tuple_of_names():
    reg = Registry("widget")
    reg.register("a", 1)

    @reg.register("b")
    def b():
        return 2

    assert list(reg) == ["a", "b"] and reg.names() == ("a", "b") and "a" in reg and "c" not in reg and 3 not in reg
    assert reg.entry("b") is b and reg["a"] == 1 and len(reg) == 2 and repr(reg) == "('a', 'b')"
    reg.register("a", 5, replace=True)
    assert reg.entry("a") == 5
    reg.unregister("a")
    assert reg.names() == ("b",)


@pytest.mark.parametrize("call, message", [
    (lambda r: r.entry("zzz"), "unknown widget 'zzz' is not one of \\('x',\\)"),
    (lambda r: r.entry("zzz", who="make: kind"), "make: kind='zzz' is not one of"),
    (lambda r: r.register("x", 2), "already registered"),
    (lambda r: r.register("", 2), "non-empty word"),
    (lambda r: r.register("a b", 2), "non-empty word"),
    (lambda r: r.unregister("zzz"), "is not one of"),
])
def test_bad_names_are_refused(call, message):
    reg = Registry("widget")
    reg.register("x", 1)
    with pytest.raises(ValueError, match=message):
        call(reg)
