"""Small, explicit machinery for patching third-party classes at run time.

A :class:`Patch` names one target (a class or module) and the attributes it replaces
or adds. Applying it keeps the originals (reachable as ``Patch.original(target, name)``
from the replacement), logs what changed, refuses to let two patches claim one name,
and is idempotent: applying the same patch again in the same process is a no-op, which
matters because vLLM loads general plugins several times and in several processes.

Nothing here imports vLLM, so the machinery is unit-tested on toy classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)

_ORIGINALS_ATTR = "__vllm_graft_originals__"
_OWNERS_ATTR = "__vllm_graft_owners__"
_MISSING = object()


class PatchError(RuntimeError):
    """A patch cannot be applied (its target changed, or another patch owns the name)."""


@dataclass(frozen=True)
class Patch:
    """Replace (or add) ``attributes`` on ``target``.

    ``must_exist``: names that must already exist on the target; a vLLM release that
    renamed them makes the patch fail loudly instead of silently adding dead code.
    """

    name: str
    target: Any
    attributes: dict[str, Any]
    must_exist: frozenset[str] = field(default_factory=frozenset)

    def apply(self) -> bool:
        """Apply once; returns False when this patch was already applied."""
        owners: dict[str, str] = _own_dict(self.target, _OWNERS_ATTR)
        originals: dict[str, Any] = _own_dict(self.target, _ORIGINALS_ATTR)
        if all(owners.get(attr) == self.name for attr in self.attributes):
            return False
        for attr in self.attributes:
            owner = owners.get(attr)
            if owner is not None and owner != self.name:
                raise PatchError(
                    f"{self.name}: {_qualname(self.target)}.{attr} is already patched "
                    f"by {owner}")
            if attr in self.must_exist and not hasattr(self.target, attr):
                raise PatchError(
                    f"{self.name}: {_qualname(self.target)} has no attribute {attr!r}; "
                    "this vLLM version is not the one the patch was written for")
        for attr, value in self.attributes.items():
            originals[attr] = self.target.__dict__.get(attr, _MISSING) \
                if isinstance(self.target, type) else getattr(self.target, attr, _MISSING)
            setattr(self.target, attr, value)
            owners[attr] = self.name
            action = "added" if originals[attr] is _MISSING else "replaced"
            logger.debug("%s: %s %s.%s", self.name, action, _qualname(self.target), attr)
        return True

    @staticmethod
    def original(target: Any, attr: str) -> Any:
        """The attribute as it was before any patch (looked up along the MRO for
        inherited methods that the patch shadowed on a subclass)."""
        originals = getattr(target, "__dict__", {}).get(_ORIGINALS_ATTR, {})
        value = originals.get(attr, _MISSING)
        if value is not _MISSING:
            return value
        if isinstance(target, type):
            for base in target.__mro__[1:]:
                if attr in base.__dict__:
                    return base.__dict__[attr]
        raise PatchError(f"{_qualname(target)}.{attr} has no original to call")


def patched_by(target: Any, attr: str) -> str | None:
    """The name of the patch that replaced ``target.attr`` (on ``target`` itself), or None."""
    return getattr(target, "__dict__", {}).get(_OWNERS_ATTR, {}).get(attr)


def call_original(target: Any, attr: str) -> Callable[..., Any]:
    """Shorthand used inside replacements: ``call_original(Cls, "m")(self, ...)``."""
    return Patch.original(target, attr)


def _own_dict(target: Any, attr: str) -> dict:
    existing = getattr(target, "__dict__", {}).get(attr)
    if existing is None:
        existing = {}
        setattr(target, attr, existing)
    return existing


def _qualname(target: Any) -> str:
    return getattr(target, "__qualname__", getattr(target, "__name__", repr(target)))
