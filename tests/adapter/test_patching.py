"""The patch machinery on toy classes (no vLLM)."""

import pytest

from vllm_graft.vllm.patching import Patch, PatchError, call_original


class Base:
    def greet(self):
        return "base"


class Child(Base):
    def name(self):
        return "child"


def test_replace_keep_original_and_idempotent():
    def name(self):
        return "patched " + call_original(Child, "name")(self)

    patch = Patch("toy.name", Child, {"name": name}, must_exist=frozenset({"name"}))
    assert patch.apply() is True
    assert patch.apply() is False  # second application in the same process: no-op
    assert Child().name() == "patched child"


def test_inherited_method_original_comes_from_the_mro():
    class Leaf(Base):
        pass

    def greet(self):
        return "leaf+" + call_original(Leaf, "greet")(self)

    Patch("toy.greet", Leaf, {"greet": greet}).apply()
    assert Leaf().greet() == "leaf+base"
    assert Base().greet() == "base"


def test_two_patches_cannot_claim_one_name():
    class Target:
        def f(self):
            return 1

    Patch("first", Target, {"f": lambda self: 2}).apply()
    with pytest.raises(PatchError, match="already patched by first"):
        Patch("second", Target, {"f": lambda self: 3}).apply()


def test_missing_target_attribute_fails_loudly():
    class Target:
        pass

    with pytest.raises(PatchError, match="no attribute 'vanished'"):
        Patch("p", Target, {"vanished": 1}, must_exist=frozenset({"vanished"})).apply()
