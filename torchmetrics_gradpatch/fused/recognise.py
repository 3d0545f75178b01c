"""Recognition by content: whether a torchmetrics function the fused sync relies on has a source it knows.

* :data:`TARGETS` names each such function (key -> module, class or ``None`` for a module-level function,
  attribute); it is the one list, which ``scripts/recognised.py`` also reads to generate the table
  (``_recognised.py``: key -> digest -> the releases that have it).
* :func:`digest` is a function's canonical digest: its own source (``inspect.getsource`` of its code object, never
  looking through ``__wrapped__``) parsed, the one ``def`` serialised without positions, docstrings (the function's
  and nested definitions'), comments and type annotations (arguments', the return's, an annotated assignment's; the
  assignment stays), with its decorators; sha256, 16 hex digits. The same source gives the same digest on Python
  3.10-3.13. ``None`` where there is no source (no file, a builtin, not a plain function). Cached per code object.
* :func:`digest_in_module` is the same digest read from a module's source text, without importing it.
* :func:`digest_of` resolves a key to the live object -- the class's own attribute (``vars(cls)``), or the module's
  -- and digests it: :data:`ABSENT` where the attribute (or its module or class) does not exist, :data:`UNKNOWN`
  where no digest of a torchmetrics source can be had. It looks through exactly this package's replacements (one
  level, by their marker) and the wrappers of ``staticmethod``, ``classmethod`` and ``contextlib.contextmanager``
  (which the source's decorators must then name), never through another tool's wrapper: that is not recognised.
* :func:`is_recognised` and :func:`unrecognised` compare with the table; :func:`snapshot` and :class:`Watch` tell
  cheaply whether any live object changed. None of these imports anything or raises but for an unknown key.

This module imports only the standard library (the generator loads it by its path, without torch); the table is
imported on first use.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import inspect
import sys
import tokenize
from collections.abc import AsyncIterator, Iterable, Iterator
from types import CodeType, FunctionType
from typing import NamedTuple

__all__ = [
    "ABSENT",
    "KEYS",
    "TARGETS",
    "UNKNOWN",
    "Target",
    "Watch",
    "digest",
    "digest_in_module",
    "digest_of",
    "is_recognised",
    "releases_of",
    "snapshot",
    "unrecognised",
]


class Target(NamedTuple):
    """A function of torchmetrics: ``module``'s class ``owner`` (``None``: the module itself) attribute ``name``."""

    module: str
    owner: str | None
    name: str


def _methods(module: str, owner: str, *names: str) -> dict[str, Target]:
    return {f"{owner}.{name}": Target(module, owner, name) for name in names}


#: What the fused sync relies on, by key. Extending it: add the entry, then regenerate the table.
TARGETS: dict[str, Target] = {
    **_methods(
        "torchmetrics.metric",
        "Metric",
        "_sync_dist",
        "sync",
        "unsync",
        "sync_context",
        "_wrap_compute",
        "forward",
        "_forward_full_state_update",
        "reset",
        "_copy_state_dict",
        "_move_list_states_to_cpu",
        "_filter_kwargs",
    ),
    **_methods(
        "torchmetrics.collections",
        "MetricCollection",
        "forward",
        "compute",
        "_compute_and_reduce",
        "items",
        "_compute_groups_create_state_ref",
    ),
    "dim_zero_cat": Target("torchmetrics.utilities.data", None, "dim_zero_cat"),
}
KEYS: tuple[str, ...] = tuple(TARGETS)

#: The digest of an attribute that does not exist (its module or class missing too): a state of its own, in the table
#: for the releases that lack it.
ABSENT = "absent"
#: The digest where none of a torchmetrics source can be had: not a plain function, no source, or an object that is
#: not what its source's decorators make of the function (the generator of a ``@contextmanager`` installed bare).
#: Never in the table.
UNKNOWN = "unknown"

#: The markers this package's replacements carry, the original in ``__wrapped__``.
_MARKS = (
    "__torchmetrics_gradpatch_sync__",
    "__torchmetrics_gradpatch_collection__",
    "__torchmetrics_gradpatch_step__",
)


def _generator() -> Iterator[None]:
    yield


async def _async_generator() -> AsyncIterator[None]:
    yield


#: The code of the wrapper each of these decorators returns (one code object for all its uses): such a wrapper is
#: looked through to the decorated function, whose source must name the decorator.
_WRAPPER_CODES = (
    (contextlib.contextmanager(_generator).__code__, "contextmanager"),
    (contextlib.asynccontextmanager(_async_generator).__code__, "asynccontextmanager"),
)
_WRAPPERS = {id(code): name for code, name in _WRAPPER_CODES}  # by identity (code compares by value); kept alive
#: Decorators that return the very function they get (they set an attribute at most), by the last part of their name:
#: ``torch.jit.unused`` and ``torch.jit.ignore``, ``abc.abstractmethod``, ``typing.final`` and ``typing.override``.
_SAME_FUNCTION = frozenset({"unused", "ignore", "abstractmethod", "final", "override"})

#: Fields that cannot change behaviour: annotations, type comments, a string's ``u`` prefix. Positions are not
#: fields (they are ``_attributes``), so they are never read.
_SKIPPED_FIELDS = frozenset({"annotation", "returns", "type_comment", "kind"})
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _emit(value: object, out: list[str]) -> None:
    """Append ``value``'s canonical text: node type names and named fields in sorted order, lists in order,
    constants as type and ``repr``; None and empty fields left out so that fields a later Python adds with an empty
    default (``type_params``) read the same."""
    if isinstance(value, ast.AST):
        out.append(type(value).__name__)
        out.append("(")
        for field in sorted(value._fields):
            if field in _SKIPPED_FIELDS:
                continue
            item = getattr(value, field, None)
            if field == "body" and isinstance(value, _DEFINITIONS) and isinstance(item, list):
                item = _without_docstring(item)
            elif field == "values" and isinstance(value, ast.JoinedStr) and isinstance(item, list):
                item = _joined(item)
            if item is None or (isinstance(item, list) and not item):
                continue
            out.append(field)
            out.append("=")
            _emit(item, out)
            out.append(",")
        out.append(")")
    elif isinstance(value, list):
        out.append("[")
        for item in value:
            _emit(item, out)  # None stays, as a placeholder: kw_defaults pairs with kwonlyargs by position
            out.append(",")
        out.append("]")
    else:
        out.append(f"{type(value).__name__}:{value!r}")


def _joined(values: list[ast.expr]) -> list[ast.expr]:
    """An f-string's parts with adjacent strings joined and empty ones left out: parsers differ there (3.10 and 3.12
    put an empty string after a nested format spec's last field, 3.11 and 3.13 do not)."""
    out: list[ast.expr] = []
    for part in values:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            if not part.value:
                continue
            last = out[-1] if out else None
            if isinstance(last, ast.Constant) and isinstance(last.value, str):
                out[-1] = ast.Constant(last.value + part.value)
                continue
        out.append(part)
    return out


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return body[1:]
    return body


def _digest_node(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    out: list[str] = []
    _emit(node, out)
    return hashlib.sha256("".join(out).encode("utf-8", "backslashreplace")).hexdigest()[:16]


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _parse_def(source: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The one ``def`` (decorators included) that ``source`` is, indented or not."""
    # An indented block parses as the body of ``if 1:`` exactly as within its module: unlike textwrap.dedent, this
    # changes no multi-line string and copes with lines less indented than the def (inside brackets or strings).
    wrapped = source[:1].isspace()
    try:
        tree = ast.parse("if 1:\n" + source if wrapped else source)
    except (SyntaxError, ValueError):
        return None
    body = tree.body
    if wrapped and len(body) == 1 and isinstance(body[0], ast.If):
        body = body[0].body
    if len(body) != 1 or not isinstance(body[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    return body[0]


#: id(code) -> (the code, its digest and the names of its decorators that wrap, outermost first; None where it has
#: no source); the code is kept so that the id stays its own.
_cache: dict[int, tuple[CodeType, tuple[str, tuple[str, ...]] | None]] = {}


def _read(fn: object) -> tuple[str, tuple[str, ...]] | None:
    if type(fn) is not FunctionType:  # exactly: a proxy (wrapt) passes isinstance and forwards __code__
        return None
    code = fn.__code__
    hit = _cache.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    try:
        node = _parse_def(inspect.getsource(code))
    except (OSError, TypeError, SyntaxError, ValueError, tokenize.TokenError):
        node = None
    found = None
    if node is not None:
        names = (_decorator_name(decorator) for decorator in node.decorator_list)
        found = (_digest_node(node), tuple(name for name in names if name not in _SAME_FUNCTION))
    _cache[id(code)] = (code, found)
    return found


def digest(fn: object) -> str | None:
    """The canonical digest of the plain function ``fn``'s own source (its decorators part of it); ``None`` when it
    has none."""
    found = _read(fn)
    return found[0] if found is not None else None


def _binding(statements: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement among ``statements`` that defines ``name`` where it is the one binding of ``name`` in that scope;
    ``None`` where there is none. Raises ``LookupError`` where the source alone cannot settle which object the name
    holds (several bindings, one inside a conditional or loop, an assignment, an import)."""
    found: list[ast.stmt | None] = []  # None: a binding that is not a statement of ``statements`` defining it
    todo: list[tuple[ast.AST, bool]] = [(stmt, True) for stmt in statements]
    while todo:
        node, top = todo.pop()
        if isinstance(node, _DEFINITIONS):
            if node.name == name:
                found.append(node if top else None)
            continue  # its body is a scope of its own
        if isinstance(node, ast.Lambda):
            continue
        if (isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load)) or (
            isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name
        ):
            found.append(None)
        todo.extend((child, False) for child in ast.iter_child_nodes(node))
    if not found:
        return None
    if len(found) > 1 or found[0] is None:
        raise LookupError(f"{name!r} is bound in a way the source alone cannot settle")
    return found[0]


def digest_in_module(source: str, owner: str | None, name: str) -> str:
    """The digest of ``owner.name`` (``owner`` a class of the module; ``None``: the module-level ``name``) read from
    the module's ``source``; :data:`ABSENT` where the class or the attribute is not there. Raises ``LookupError``
    where it is bound otherwise than by one ``def`` (see :func:`_binding`)."""
    scope = ast.parse(source).body
    if owner is not None:
        cls = _binding(scope, owner)
        if cls is None:
            return ABSENT
        if not isinstance(cls, ast.ClassDef):
            raise LookupError(f"{owner!r} is not a class statement")
        scope = cls.body
    node = _binding(scope, name)
    if node is None:
        return ABSENT
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise LookupError(f"{name!r} is not a def")
    return _digest_node(node)


_MISSING = object()
_ODD = object()  # the owner is there but is no class: no digest


def _raw(target: Target) -> object:
    """The live attribute as stored (the class's own, not inherited), ``_MISSING`` or ``_ODD``."""
    module = sys.modules.get(target.module)
    if module is None:
        return _MISSING
    holder: object = module
    if target.owner is not None:
        holder = vars(module).get(target.owner, _MISSING)
        if holder is _MISSING:
            return _MISSING
        if not isinstance(holder, type):
            return _ODD
    return vars(holder).get(target.name, _MISSING)


def _resolve(raw: object) -> tuple[object, tuple[str, ...]]:
    """The function whose source the digest reads, and the decorators whose wrappers were looked through to get it
    (outermost first): this package's replacement (one level, by its marker), then a ``staticmethod`` or
    ``classmethod``, then a known decorator's wrapper."""
    layers: tuple[str, ...] = ()
    if type(raw) is FunctionType and raw.__dict__ and _marked(raw.__dict__):
        raw = raw.__dict__.get("__wrapped__")
    if type(raw) is staticmethod or type(raw) is classmethod:
        layers, raw = (type(raw).__name__,), raw.__func__
    if type(raw) is FunctionType and id(raw.__code__) in _WRAPPERS:
        layers, raw = (*layers, _WRAPPERS[id(raw.__code__)]), raw.__dict__.get("__wrapped__")
    return raw, layers


def _marked(attributes: dict[str, object]) -> bool:
    return any(map(attributes.get, _MARKS))


def digest_of(key: str) -> str:
    """The digest of ``key``'s live function: hex, :data:`ABSENT` or :data:`UNKNOWN`. ``KeyError`` for a key not
    in :data:`TARGETS`."""
    raw = _raw(TARGETS[key])
    if raw is _MISSING:
        return ABSENT
    fn, layers = _resolve(raw)
    found = _read(fn)
    if found is None or found[1] != layers:  # the decorators its source names must be the wrappers looked through
        return UNKNOWN
    return found[0]


def _table() -> dict[str, dict[str, str]]:
    from torchmetrics_gradpatch.fused._recognised import RECOGNISED

    return RECOGNISED


def is_recognised(key: str) -> bool:
    """Whether ``key``'s live function has a source of a release the table was generated from."""
    return digest_of(key) in _table().get(key, {})


def releases_of(key: str, found: str) -> str:
    """The releases (such as ``"0.11.0-1.4.3, main"``) whose ``key`` has the digest ``found``; ``""`` where none
    has."""
    return _table().get(key, {}).get(found, "")


def snapshot(keys: Iterable[str] = KEYS) -> tuple[object, ...]:
    """The identity of ``keys``' live objects: each attribute as stored and the code of the function it resolves
    to. Compare two with ``is``, element by element (:class:`Watch` does)."""
    out: list[object] = []
    for key in keys:
        raw = _raw(TARGETS[key])
        out.append(raw)
        out.append(getattr(_resolve(raw)[0], "__code__", None))
    return tuple(out)


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


#: keys -> (their snapshot, the keys not recognised then)
_answers: dict[tuple[str, ...], tuple[tuple[object, ...], tuple[str, ...]]] = {}


def unrecognised(keys: Iterable[str] = KEYS) -> list[str]:
    """The keys among ``keys`` whose live function is not recognised, in order. Digested again only for a live
    object that changed since the last call with the same keys."""
    keys = tuple(keys)
    now = snapshot(keys)
    last = _answers.get(keys)
    if last is not None and _same(last[0], now):
        return list(last[1])
    answer = tuple(key for key in keys if not is_recognised(key))
    _answers[keys] = (now, answer)
    return list(answer)


class Watch:
    """Whether any of ``keys``' live objects changed since this watch last looked: one :func:`snapshot` per call."""

    def __init__(self, keys: Iterable[str] = KEYS) -> None:
        self.keys = tuple(keys)
        self._last: tuple[object, ...] | None = None

    def changed(self) -> bool:
        """True on the first call, and whenever a live object differs from the previous call's."""
        now = snapshot(self.keys)
        if self._last is not None and _same(self._last, now):
            return False
        self._last = now
        return True
