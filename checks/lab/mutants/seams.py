"""Seams: where a mutant of the failure lab patches the runtime, and how it is put back.

A mutant never edits a file and is never reachable from the runtime's own code path: it is a
list of :class:`Patch` values, each naming one **seam** -- a module attribute, a class
attribute (method, property) or a mapping entry -- by its dotted path
(``"decodespec.impl.policy:greedy_select"``, ``"decodespec.impl.runtime:RequestRunner._forward"``,
``"decodespec.impl.policy:_TRANSFORMS[top_p]"``).  :func:`install` resolves every patch, builds
the replacement and sets it, and restores the exact original object (the same object, ``is``)
on exit, also when the body raises; a seam that a class only inherits is deleted again.

A replacement is built in one of two ways:

* ``edits``: **source mutation** -- the seam's own source (``inspect.getsource``) with textual
  edits ``(old, new)``, each of which must occur exactly once (else :class:`SeamMoved`: the
  runtime changed under the mutant, which must be rewritten, never silently weakened), compiled
  into the seam's module namespace (decorators dropped, zero-argument ``super()`` kept working).
  The edit pair *is* the bug, readable in the mutant's definition;
* ``wrap``: a function ``original -> replacement`` (for a bug that post-processes a result).

Every installed replacement is a **dispatcher**: it runs the mutated code on the runtime side
and the original code on the oracle side (:func:`oracle_side`).  The gate's decoder reference
(:mod:`decodespec.checks.gate.reference`, float64, no ``impl/`` code) cannot see a patched seam at
all; the oracle side remains for the references that still run ``impl/`` code (the
encoder-decoder reference, :data:`ORACLE_ENTRY_POINTS`, installed by :func:`spec_side`).

:func:`fingerprint` records the object at each seam, so a test can prove that after every
mutant the normal path holds exactly the objects it held before.

Source: M3.10 0x0B "Shape-correct failure lab" (bugs that keep every shape);
research/formal-anchors-survey.md 7 (mutants killed by the gate); research/aesthetics-survey.md
8.6 (``checks/lab/mutants.py``: seeded impl bugs the checks must catch).
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import importlib
import inspect
import pkgutil
import re
import sys
import textwrap
import types
from typing import Any, Callable, Iterator, Sequence

import attrs

__all__ = [
    "MISSING",
    "ORACLE_ENTRY_POINTS",
    "Patch",
    "aliases",
    "SeamMoved",
    "fingerprint",
    "install",
    "leaked",
    "preload",
    "is_oracle_side",
    "mutated_source",
    "oracle_side",
    "resolve",
    "spec_side",
]

#: Placeholder of "no attribute / no entry here" in fingerprints.
MISSING = "<missing>"

_ORACLE: contextvars.ContextVar[bool] = contextvars.ContextVar("decodespec_mutant_oracle_side", default=False)
_ITEM = re.compile(r"^(?P<path>[^\[]+)\[(?P<key>[^\]]+)\]$")


class SeamMoved(Exception):
    """A mutant's seam no longer exists or its source edit no longer matches exactly once."""


@contextlib.contextmanager
def oracle_side() -> Iterator[None]:
    """Run the body as the specification side: every installed dispatcher calls the original code."""
    token = _ORACLE.set(True)
    try:
        yield
    finally:
        _ORACLE.reset(token)


def is_oracle_side() -> bool:
    """Whether the current context is the specification side (see :func:`oracle_side`)."""
    return _ORACLE.get()


@attrs.frozen
class Patch:
    """One seam and how to replace it.

    Attributes:
        target: ``"module:Qual.name"`` (an attribute) or ``"module:Qual.name[key]"`` (an entry
            of the mapping at ``module:Qual.name``).
        edits: Source edits ``((old, new), ...)`` applied to the seam's source (each ``old``
            must occur exactly once).
        wrap: ``original -> replacement`` instead of edits.
        source: Take the source to edit from this seam instead of ``target`` (install a mutated
            copy of an inherited method on a subclass: target ``StaticCache.update``, source
            ``_CacheLedger.update``).
    """

    target: str
    edits: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=lambda e: tuple(tuple(p) for p in e))
    wrap: Callable[[Any], Any] | None = attrs.field(default=None, eq=False)
    source: str | None = None

    def __attrs_post_init__(self) -> None:
        if bool(self.edits) == (self.wrap is not None):
            raise ValueError(f"patch {self.target}: give either edits or wrap")


# --------------------------------------------------------------------------------------------
# Resolution.
# --------------------------------------------------------------------------------------------


def _walk(path: str) -> tuple[Any, str]:
    """``"module:A.b"`` -> (the object holding ``b``, ``"b"``)."""
    module_name, _, qual = path.partition(":")
    if not qual:
        raise SeamMoved(f"seam {path!r} must be written 'module:qualified.name'")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise SeamMoved(f"seam {path!r}: {exc}") from None
    parts = qual.split(".")
    for part in parts[:-1]:
        try:
            owner = getattr(owner, part)
        except AttributeError:
            raise SeamMoved(f"seam {path!r}: {part!r} does not exist") from None
    return owner, parts[-1]


def resolve(target: str) -> tuple[Any, Any, bool]:
    """``(container, key, is_item)`` of a seam: a module / class and an attribute name, or a mapping and a key.

    Raises:
        SeamMoved: the module, class, attribute or mapping does not exist.
    """
    match = _ITEM.match(target)
    if match:
        owner, name = _walk(match["path"])
        mapping = getattr(owner, name, None)
        if not isinstance(mapping, dict):
            raise SeamMoved(f"seam {target!r}: {match['path']!r} is not a dict")
        return mapping, match["key"], True
    owner, name = _walk(target)
    if not hasattr(owner, name):
        raise SeamMoved(f"seam {target!r}: {name!r} does not exist")
    return owner, name, False


def _current(container: Any, key: Any, is_item: bool) -> Any:
    """The object stored at the seam itself (``MISSING`` when a class only inherits it)."""
    if is_item:
        return container.get(key, MISSING)
    return vars(container).get(key, MISSING)


def _static(container: Any, key: Any, is_item: bool) -> Any:
    """The object the seam resolves to (inherited class attributes included)."""
    if is_item:
        return container[key]
    return inspect.getattr_static(container, key)


def fingerprint(targets: Sequence[str]) -> dict[str, Any]:
    """``{seam: object}`` of the objects stored now at ``targets`` and at their aliases (compare with ``is``)."""
    preload()
    out: dict[str, Any] = {}
    for target in targets:
        container, key, is_item = resolve(target)
        out[target] = _current(container, key, is_item)
        for module, name in aliases(container, key, is_item):
            out[f"{module.__name__}:{name}"] = vars(module)[name]
    return out


# --------------------------------------------------------------------------------------------
# Source mutation.
# --------------------------------------------------------------------------------------------


def _function_of(obj: Any) -> Callable[..., Any]:
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    if isinstance(obj, property):
        return obj.fget
    if inspect.isfunction(obj):
        return obj
    raise SeamMoved(f"{obj!r} is not a function, method or property")


def mutated_source(func: Callable[..., Any], edits: Sequence[tuple[str, str]], label: str) -> str:
    """``func``'s dedented source with ``edits`` applied (each ``old`` exactly once).

    Raises:
        SeamMoved: an ``old`` text occurs zero or several times.
    """
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as exc:
        raise SeamMoved(f"{label}: source unavailable ({exc})") from None
    for old, new in edits:
        count = source.count(old)
        if count != 1:
            raise SeamMoved(f"{label}: the edit {old!r} matches {count} times in {func.__qualname__} (expected exactly once); "
                            "the runtime changed: rewrite the mutant")
        source = source.replace(old, new)
    return source


def compile_mutation(func: Callable[..., Any], edits: Sequence[tuple[str, str]], label: str) -> Callable[..., Any]:
    """A new function: ``func``'s source with ``edits``, compiled in ``func``'s module globals.

    Decorators are dropped (a registration decorator must not run twice); the function is
    defined inside a factory whose parameter ``__class__`` keeps zero-argument ``super()``
    working for methods.  The new function's globals are the module's own dict (live lookups).
    """
    source = mutated_source(func, edits, label)
    tree = ast.parse(source)
    fn = tree.body[0]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise SeamMoved(f"{label}: {func.__qualname__} is not a def")
    fn.decorator_list = []
    factory = ast.parse("def __mutant_factory__(__class__):\n    pass\n").body[0]
    factory.body = [fn, ast.Return(ast.Name(fn.name, ast.Load()))]
    module = ast.fix_missing_locations(ast.Module([factory], type_ignores=[]))
    namespace: dict[str, Any] = {}
    exec(compile(module, f"<mutant {label}>", "exec"), func.__globals__, namespace)  # noqa: S102 - the mutated seam
    owner_class = None
    qual = func.__qualname__.split(".")
    if len(qual) > 1:
        owner_class = getattr(inspect.getmodule(func), qual[0], None)
    new = namespace["__mutant_factory__"](owner_class)
    new.__qualname__ = func.__qualname__
    new.__module__ = func.__module__
    new.__doc__ = func.__doc__
    return new


# --------------------------------------------------------------------------------------------
# Dispatchers and installation.
# --------------------------------------------------------------------------------------------


def _dispatch(original: Any, replacement: Any) -> Any:
    """A callable (or descriptor) that runs ``replacement`` on the runtime side and ``original`` on the oracle side."""
    if isinstance(original, property):
        new_get = _function_of(replacement)
        old_get = original.fget

        def getter(self: Any) -> Any:
            return (old_get if _ORACLE.get() else new_get)(self)

        getter.__decodespec_mutant__ = True  # type: ignore[attr-defined]
        return property(getter, original.fset, original.fdel, original.__doc__)
    kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
    old_fn = original.__func__ if kind else original
    new_fn = replacement.__func__ if isinstance(replacement, (staticmethod, classmethod)) else replacement
    if not callable(old_fn) or not callable(new_fn):
        raise SeamMoved(f"seam holds a non-callable {original!r}; mutants patch functions, methods and properties")

    @functools.wraps(old_fn)
    def seam(*args: Any, **kwargs: Any) -> Any:
        return (old_fn if _ORACLE.get() else new_fn)(*args, **kwargs)

    seam.__decodespec_mutant__ = True  # type: ignore[attr-defined]
    return kind(seam) if kind else seam


def aliases(container: Any, key: Any, is_item: bool) -> list[tuple[Any, str]]:
    """Other module-level names bound to the same function as a module-attribute seam.

    ``from .policy import decide as policy_decide`` makes ``decodespec.impl.runtime.policy_decide``
    the same object as ``decodespec.impl.policy.decide``: the seam is the function, wherever a
    ``decodespec`` module binds it (this package excepted).
    """
    if is_item or not isinstance(container, types.ModuleType):
        return []
    original = vars(container).get(key, MISSING)
    if not inspect.isfunction(original):
        return []
    out = []
    for name, module in sorted(sys.modules.items()):
        if module is None or module is container or not name.startswith("decodespec.") or name.startswith(__package__ or "-"):
            continue
        out += [(module, attr) for attr, value in sorted(vars(module).items()) if value is original]
    return out


#: Packages whose modules are imported before a mutant is installed, so that no module binds a
#: dispatcher by a late ``from ... import`` that the restore would not see.
PRELOAD = ("decodespec.impl", "decodespec.checks.adapters")


def preload() -> None:
    """Import every module of :data:`PRELOAD` (idempotent)."""
    for package_name in PRELOAD:
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__, package_name + "."):
            importlib.import_module(info.name)


def leaked() -> list[str]:
    """``module:name`` of every ``decodespec`` module binding that still holds a mutant dispatcher (should be none)."""
    out = []
    for name, module in sorted(sys.modules.items()):
        if module is None or not name.startswith("decodespec."):
            continue
        for attr, value in vars(module).items():
            objs = [value] + (list(vars(value).values()) if isinstance(value, type) and value.__module__ == name else [])
            objs += list(value.values()) if isinstance(value, dict) else []
            for obj in objs:
                fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else (obj.fget if isinstance(obj, property) else obj)
                if getattr(fn, "__decodespec_mutant__", False):
                    out.append(f"{name}:{attr}")
    return sorted(set(out))


def build(patch: Patch, label: str) -> list[tuple[Any, Any, bool, Any]]:
    """``[(container, key, is_item, dispatcher), ...]`` for ``patch``: its seam and the seam's aliases (nothing is set yet).

    Raises:
        SeamMoved: the seam or its source edit no longer matches.
    """
    container, key, is_item = resolve(patch.target)
    original = _static(container, key, is_item)
    if patch.wrap is not None:
        inner = _function_of(original) if isinstance(original, (staticmethod, classmethod, property)) else original
        replacement = patch.wrap(inner)
    else:
        src_obj = original
        if patch.source is not None:
            s_container, s_key, s_item = resolve(patch.source)
            src_obj = _static(s_container, s_key, s_item)
        replacement = compile_mutation(_function_of(src_obj), patch.edits, f"{label}: {patch.source or patch.target}")
    dispatcher = _dispatch(original, replacement)
    return [(container, key, is_item, dispatcher)] + [(module, name, False, dispatcher) for module, name in aliases(container, key, is_item)]


@contextlib.contextmanager
def install(patches: Sequence[Patch], label: str) -> Iterator[None]:
    """Install every patch (all built before any is set) and restore the exact originals on exit.

    Raises:
        SeamMoved: a seam or an edit no longer matches (nothing is installed then).
    """
    preload()
    built = [seam for p in patches for seam in build(p, label)]
    saved: list[tuple[Any, Any, bool, Any]] = []
    try:
        for container, key, is_item, dispatcher in built:
            saved.append((container, key, is_item, _current(container, key, is_item)))
            if is_item:
                container[key] = dispatcher
            else:
                setattr(container, key, dispatcher)
        yield
    finally:
        for container, key, is_item, old in reversed(saved):
            if is_item:
                if old is MISSING:
                    container.pop(key, None)
                else:
                    container[key] = old
            elif old is MISSING:
                delattr(container, key)
            else:
                setattr(container, key, old)


#: The gate's reference computations (the specification side of every comparison).
ORACLE_ENTRY_POINTS: tuple[str, ...] = (
    "decodespec.checks.gate.procedures:encdec_reference",
)


def _on_oracle_side(original: Callable[..., Any]) -> Callable[..., Any]:
    def reference(*args: Any, **kwargs: Any) -> Any:
        with oracle_side():
            return original(*args, **kwargs)

    return reference


@contextlib.contextmanager
def spec_side() -> Iterator[None]:
    """Run every gate reference computation (:data:`ORACLE_ENTRY_POINTS`) on the oracle side.

    Raises:
        SeamMoved: an entry point no longer exists (the gate changed: update the list).
    """
    with install([Patch(target, wrap=_on_oracle_side) for target in ORACLE_ENTRY_POINTS], "gate reference"):
        yield
