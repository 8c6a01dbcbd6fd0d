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
    reg.register("a", 5, overwrite=True)
    assert reg.entry("a") == 5
    reg.unregister("a")
    assert reg.names() == ("b",)


@pytest.mark.parametrize("call, message", [
    (lambda r: r.entry("zzz"), "unknown widget 'zzz' is not one of \\('x',\\)"),
    (lambda r: r.entry("zzz", who="make: kind"), "make: kind='zzz' is not one of"),
    (lambda r: r.register("x", 2), "widget 'x' is already registered in the widget registry: pass overwrite=True"),
    (lambda r: r.register("", 2), "non-empty word"),
    (lambda r: r.register("a b", 2), "non-empty word"),
    (lambda r: r.unregister("zzz"), "is not one of"),
])
def test_bad_names_are_refused(call, message):
    reg = Registry("widget")
    reg.register("x", 1)
    with pytest.raises(ValueError, match=message):
        call(reg)


def test_any_value_is_an_entry_none_included():
    reg = Registry("widget")
    reg.register("none", None)
    assert "none" in reg and reg["none"] is None and reg.entry("none") is None

    @reg.register("f")
    def f():
        return 1

    assert reg["f"] is f


def test_a_taken_name_is_refused_unless_overwrite_and_the_entry_stays():
    reg = Registry("widget", owner="mypkg.WIDGETS")
    reg.register("x", 1)
    with pytest.raises(ValueError, match=r"widget 'x' is already registered in mypkg.WIDGETS: pass overwrite=True"):
        reg.register("x", 2)
    with pytest.raises(ValueError, match="overwrite=True"):
        reg.register("x")(lambda: 3)  # the decorator form too
    assert reg.entry("x") == 1  # the refused registration changed nothing
    reg.register("x", 2, overwrite=True)
    assert reg.entry("x") == 2 and reg.names() == ("x",)


def _every_builtin_registry():
    """(registry, a built-in name, a register call for it) of each registry users can add to."""
    from headscope import fusion, metrics, selection, zoo
    from headscope.evaluate import registry as evals
    from headscope.evaluate.phrasings import PHRASINGS
    from headscope.patching import backends
    from headscope.tasks import TASKS, register_task
    from headscope.tasks.reasoning import FAMILIES

    return [
        (selection.STRATEGIES, "global", lambda **kw: selection.register_strategy("global", lambda i: [], **kw)),
        (backends.BACKENDS, "hf", lambda **kw: backends.register_backend("hf", lambda m, h, b: None, **kw)),
        (backends.PATH_BACKENDS, next(iter(backends.PATH_BACKENDS)),
         lambda **kw: backends.register_path_backend(next(iter(backends.PATH_BACKENDS)), lambda h, r, b: None, **kw)),
        (TASKS, "niah", lambda **kw: register_task("niah", lambda **c: None, **kw)),
        (evals.EVALUATIONS, "niah", lambda **kw: evals.register_evaluation("niah", lambda *a: [],
                                                                           evals.EVALUATIONS["niah"].Config, **kw)),
        (evals.SUITES, "smoke", lambda **kw: evals.register_suite("smoke", ["niah"], **kw)),
        (metrics.METRICS, "logit_diff", lambda **kw: metrics.METRICS.register("logit_diff", abs, **kw)),
        (fusion.STABILITY_METHODS, "frac", lambda **kw: fusion.STABILITY_METHODS.register("frac", abs, **kw)),
        (fusion.COMBINE_RULES, "max", lambda **kw: fusion.COMBINE_RULES.register("max", abs, **kw)),
        (fusion.NORMALIZE_MODES, "max", lambda **kw: fusion.NORMALIZE_MODES.register("max", abs, **kw)),
        (FAMILIES, "binding", lambda **kw: FAMILIES.register("binding", object, **kw)),
        (PHRASINGS, "code", lambda **kw: PHRASINGS.register("code", ("{value}", "?"), **kw)),
        (zoo.MODELS, "smollm2-135m", lambda **kw: zoo.MODELS.register("smollm2-135m", object(), **kw)),
    ]


def test_no_builtin_is_replaced_silently():
    """Every registry refuses to replace a built-in without overwrite=True (a result labelled with a built-in's
    name then always comes from the built-in), and replaces it with overwrite=True."""
    for registry, name, register in _every_builtin_registry():
        assert isinstance(registry, Registry), registry
        builtin = registry[name]
        with pytest.raises(ValueError, match=f"'{name}' is already registered in .*overwrite=True"):
            register()
        assert registry[name] is builtin, registry.kind
        try:
            register(overwrite=True)
            assert registry[name] is not builtin, registry.kind
        finally:
            registry.register(name, builtin, overwrite=True)
        assert registry[name] is builtin
