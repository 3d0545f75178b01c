"""Recognition: whether the modules the fused sync relies on (:data:`MODULES`) are, live, what a known release's
source makes of them (:func:`unrecognised`, which never raises), and which parts of the fused sync step aside
(:data:`PARTS`, :func:`stepping_aside`) while one is not. Imports only the standard library (``scripts/recognised.py``
loads it by its path). docs/fused-sync.md#where-it-steps-aside says what is recognised; docs/design.md#recognition how.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import hashlib
import inspect
import sys
import tokenize
import warnings
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from operator import attrgetter, is_
from types import CodeType, FunctionType, ModuleType
from typing import Any, NamedTuple

#: The modules recognised whole, each with the package whose releases the table covers it for. A module that is not
#: imported is not judged (nothing of it runs).
MODULES: dict[str, str] = {
    "torchmetrics.utilities.data": "torchmetrics",
    "torchmetrics.utilities.distributed": "torchmetrics",
    "torchmetrics.utilities": "torchmetrics",
    "torchmetrics.metric": "torchmetrics",
    "torchmetrics.collections": "torchmetrics",
    "lightning_utilities.core.apply_func": "lightning_utilities",
    "lightning_utilities": "lightning_utilities",
}

SINGLE = "the fused sync of one Metric"
COMPUTE = "MetricCollection.compute's one exchange"
STEP = "MetricCollection.forward's one exchange"
#: part -> the modules whose lines it reproduces or whose behaviour it assumes
PARTS = {
    SINGLE: tuple(m for m in MODULES if m != "torchmetrics.collections"),
    COMPUTE: tuple(MODULES),
    STEP: tuple(MODULES),
}


#: The code of the wrapper each decorator returns, one for all its uses (made here around print): looked through.
_WRAPPERS = {name: getattr(contextlib, name)(print).__code__ for name in ("contextmanager", "asynccontextmanager")}
#: Decorators that return the very function they get, by the last part of their name (``torch.jit.unused`` and
#: ``ignore``, ``abc.abstractmethod``, ``typing.final`` and ``override``).
_SAME_FUNCTION = frozenset({"unused", "ignore", "abstractmethod", "final", "override"})
#: Fields that cannot change behaviour: annotations, type comments, a string's ``u`` prefix (positions: never read).
_SKIPPED_FIELDS = frozenset({"annotation", "returns", "type_comment", "kind"})
_DOCUMENTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)  # a docstring is left out of digests
_Def = ast.FunctionDef | ast.AsyncFunctionDef
_MISSING = object()


def _emit(value: object, out: list[str]) -> None:
    """Append ``value``'s canonical text: node type names and named fields in sorted order, lists in order,
    constants as type and ``repr``; None and empty fields left out (so a field a later Python adds reads the same)."""
    if isinstance(value, ast.AST):
        out += (type(value).__name__, "(")
        for field in sorted(value._fields):
            item = getattr(value, field, None)
            if field == "body" and isinstance(value, _DOCUMENTED) and ast.get_docstring(value, clean=False) is not None:
                item = value.body[1:]
            elif isinstance(value, ast.JoinedStr) and field == "values":
                # adjacent strings joined, empty ones left out: 3.10 and 3.12 put an empty string after a nested
                # format spec's last field, 3.11 and 3.13 do not
                item = []
                for part in value.values:
                    if not isinstance(part, ast.Constant):
                        item.append(part)
                    elif item and isinstance(item[-1], ast.Constant):
                        item[-1] = ast.Constant(f"{item[-1].value!s}{part.value!s}")
                    elif part.value:
                        item.append(part)
            if field not in _SKIPPED_FIELDS and item is not None and item != []:
                out += (field, "=")
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


def _digest_node(node: ast.AST) -> str:
    out: list[str] = []
    _emit(node, out)
    return hashlib.sha256("".join(out).encode("utf-8", "backslashreplace")).hexdigest()[:16]


def module_digest(source: str) -> str:
    """The canonical digest of a whole module's ``source``. Raises ``SyntaxError`` where it does not parse."""
    return _digest_node(ast.parse(source))


def _decorator_name(node: ast.expr) -> str:
    """The last part of a decorator's name, called or not (``""`` where it is no name)."""
    node = node.func if isinstance(node, ast.Call) else node
    return str(getattr(node, "attr", getattr(node, "id", "")))


def _table() -> dict[str, dict[str, str]]:
    from torchmetrics_gradpatch.fused._recognised import RECOGNISED

    return RECOGNISED


def releases_of(module: str, found: str) -> str:
    """The releases (``"0.11.0-1.4.3, main"``) whose ``module`` has the digest ``found``; ``""`` where none has."""
    return _table().get(module, {}).get(found, "")


def release_of(name: str) -> str:
    """The releases whose source the live module ``name`` has (``""``: none, or it is not imported)."""
    module = sys.modules.get(name)
    source = _source(name, module) if module is not None else None
    return "" if source is None else releases_of(name, source.digest)


class _Scope:
    """What one scope of a module's source (its top level, or a class body) binds by ``def``, ``class`` and
    ``import`` in every branch, and the names it binds otherwise (:attr:`other`: vouched for by the digest only)."""

    def __init__(self, body: list[ast.stmt], package: str) -> None:
        self.defs: dict[str, list[_Def]] = {}
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self.imports: dict[str, list[tuple[str, str | None]]] = {}  # name -> (module, attribute; None: the module)
        self.other: set[str] = set()
        todo: list[ast.AST] = list(body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if "overload" not in map(_decorator_name, node.decorator_list):  # a stub the next def replaces
                    self.defs.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.Import):
                for alias in node.names:  # import a.b binds a; import a.b as c binds c to a.b
                    origin = alias.name if alias.asname else alias.name.split(".")[0]
                    self.imports.setdefault(alias.asname or origin, []).append((origin, None))
            elif isinstance(node, ast.ImportFrom):
                origin = node.module or ""
                if node.level:  # relative: from the module's package upwards
                    base = package.rsplit(".", node.level - 1)[0]
                    origin = f"{base}.{origin}" if origin else base
                for alias in node.names:
                    if alias.name != "*":  # a star import binds what the module's digest vouches for
                        self.imports.setdefault(alias.asname or alias.name, []).append((origin, alias.name))
            elif isinstance(node, ast.If | ast.Try | ast.For | ast.While | ast.With):
                todo.extend(ast.iter_child_nodes(node))  # bodies, handlers, and the names they bind
            elif isinstance(node, ast.ExceptHandler):
                todo.extend(node.body)
                if node.name:
                    self.other.add(node.name)
            elif not isinstance(node, ast.Lambda):
                names = (child for child in ast.walk(node) if isinstance(child, ast.Name))
                self.other.update(name.id for name in names if not isinstance(name.ctx, ast.Load))


class _Source(NamedTuple):
    """A module's source as read once: its digest, its top-level scope, its code objects by (first line, name)."""

    digest: str
    tree: ast.Module
    codes: dict[tuple[int, str], CodeType]


@functools.lru_cache(maxsize=len(MODULES))  # a module object's source does not change under it: kept across reset()
def _source(name: str, module: ModuleType) -> _Source | None:
    try:
        text = inspect.getsource(module)
        tree = ast.parse(text)
        # dont_inherit: this module's own future flags must not change the code compiled
        compiled = compile(text, getattr(module, "__file__", None) or name, "exec", dont_inherit=True)
    except (OSError, TypeError, SyntaxError, ValueError, tokenize.TokenError):
        return None
    codes: dict[tuple[int, str], CodeType] = {}
    todo = [compiled]
    while todo:
        for const in todo.pop().co_consts:
            if isinstance(const, CodeType):
                codes[const.co_firstlineno, const.co_name] = const
                todo.append(const)
    return _Source(_digest_node(tree), tree, codes)


class _Judgement:
    """One judgement of the modules, made when created (:attr:`answer`: what :func:`unrecognised` returns), and what
    it looked at (namespaces, their sizes and the names read in them; functions and their cells), to tell by identity
    whether anything changed since (:meth:`freeze`, :meth:`same`)."""

    def __init__(self) -> None:
        self.namespaces: list[tuple[Mapping[str, Any], tuple[str, ...]]] = []
        self.functions: list[FunctionType] = []
        bad: list[str] = []
        for name in MODULES:
            module = sys.modules.get(name)
            if module is None:
                continue
            source = _source(name, module)
            if source is None or source.digest not in _table().get(name, {}):
                bad.append(name)
                continue
            self.source, self.module, self.namespace = source, module, vars(module)
            bad += self.scope(source.tree.body, self.namespace, None, f"{name}.")
        self.answer = tuple(bad)

    def freeze(self) -> bool:
        """Take the live objects now; False where one is gone already (a name deleted, a cell emptied)."""
        # __defaults__ where a function has some, __kwdefaults__ where it has keyword-only arguments: set on another,
        # they only let through a call that would raise for a missing argument (the judgement still names them)
        defaulted = [fn for fn in self.functions if fn.__code__.co_argcount and fn.__defaults__]
        keyworded = [fn for fn in self.functions if fn.__code__.co_kwonlyargcount]
        cells = [cell for fn in self.functions for cell in fn.__closure__ or ()]
        groups: list[tuple[Callable[[Any], object], Sequence[Any]]] = [(sys.modules.get, tuple(MODULES))]
        groups += [(namespace.__getitem__, names) for namespace, names in self.namespaces if names]
        groups += [(attrgetter("__code__"), self.functions), (attrgetter("__defaults__"), defaulted)]
        groups += [(attrgetter("__kwdefaults__"), keyworded), (attrgetter("cell_contents"), cells)]
        try:
            self.checks = [(read, items, tuple(map(read, items))) for read, items in groups]
        except (KeyError, AttributeError, ValueError):
            return False
        self.sizes = [len(namespace) for namespace, _ in self.namespaces]
        return True

    def same(self) -> bool:
        """Whether every object :meth:`freeze` took is still the one there (identity, never ``==``)."""
        try:
            return [len(namespace) for namespace, _ in self.namespaces] == self.sizes and all(
                all(map(is_, map(read, items), last)) for read, items, last in self.checks
            )
        except (KeyError, AttributeError, ValueError):  # a name deleted, a cell emptied: changed
            return False

    def scope(self, body: list[ast.stmt], namespace: Mapping[str, Any], owner: type | None, where: str) -> list[str]:
        scope = _Scope(body, self.module.__package__ or "")
        names = sorted({*scope.defs, *scope.classes, *scope.imports} - scope.other)
        self.namespaces.append((namespace, tuple(name for name in names if name in namespace)))
        bad: list[str] = []
        for name in names:
            live = namespace.get(name, _MISSING)
            ok = any(self.imported(live, origin) for origin in scope.imports.get(name, ()))
            ok = ok or any(self.is_class(live, node, f"{where}{name}", bad) for node in scope.classes.get(name, ()))
            ok = ok or self.defined(live, scope.defs.get(name, []), namespace, owner)
            if not ok:
                bad.append(f"{where}{name}")
        if owner is None:  # a global the source does not bind would shadow a builtin of the same name
            shadowing = (self.namespace.keys() & vars(builtins).keys()) - {*names, *scope.other}
            bad += sorted(f"{where}{name}" for name in shadowing if not name.startswith("__"))
        return bad

    def imported(self, live: object, origin: tuple[str, str | None]) -> bool:
        module = sys.modules.get(origin[0], _MISSING)
        return live is (module if origin[1] is None else getattr(module, origin[1], _MISSING))

    def is_class(self, live: object, node: ast.ClassDef, qualified: str, bad: list[str]) -> bool:
        prefix = self.module.__name__
        if not isinstance(live, type) or live.__module__ != prefix or live.__qualname__ != qualified[len(prefix) + 1 :]:
            return False
        if not node.keywords:  # its bases as the source names them (no bases: object alone)
            bases = live.__bases__
            if not (self.is_made(bases, ast.Tuple(node.bases), self.namespace) if node.bases else bases[0] is object):
                return False  # object is never a base beside another
        bad += self.scope(node.body, vars(live), live, f"{qualified}.")
        return True

    def defined(self, live: object, nodes: list[_Def], namespace: Mapping[str, Any], owner: type | None) -> bool:
        # only _site marks a replacement (not imported: there is none; this module stays loadable by its path)
        site = sys.modules.get("torchmetrics_gradpatch._site")
        if type(live) is FunctionType and site is not None and any(map(live.__dict__.get, site.MARKS)):
            live = live.__dict__.get("__wrapped__")  # this package's replacement: judge the original
        if type(live) is property and (len(nodes) != 1 or live.fset is not None or live.fdel is not None):
            return False  # only a property with a getter alone is looked through
        return any(self.function(live, node, namespace, owner) for node in nodes)

    def function(self, live: object, node: _Def, namespace: Mapping[str, Any], owner: type | None) -> bool:
        """Whether ``live`` is what ``node`` makes, looked through the wrappers its decorators name."""
        decorators = [name for name in map(_decorator_name, node.decorator_list) if name not in _SAME_FUNCTION]
        for position, name in enumerate(decorators):
            if name == "property" and not position and type(live) is property:
                live = live.fget
            elif name in ("staticmethod", "classmethod") and type(live) is getattr(builtins, name):
                live = live.__func__  # type: ignore[attr-defined]
            elif name in _WRAPPERS and type(live) is FunctionType:
                self.functions.append(live)
                inner = live.__dict__.get("__wrapped__")
                cells = live.__closure__ or ()
                if live.__code__ is not _WRAPPERS[name] or len(cells) != 1 or _contents(cells[0]) is not inner:
                    return False  # not the decorator's wrapper, or one that calls another function
                live = inner
            else:
                return False  # a decorator whose wrapper this module does not know
        if type(live) is not FunctionType:
            return False
        self.functions.append(live)  # what is judged is watched, recognised or not, so that putting it back is noticed
        engine = sys.modules.get("torchmetrics_gradpatch._engine")
        state = getattr(engine, "_state", None)
        code = live.__code__
        if state is not None and live is state.function and code is engine._TRAMPOLINE_CODE:  # type: ignore[union-attr]
            code = state.original_code  # torchmetrics' gather running the patch's trampoline: judge its own code
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        args = node.args
        kw = {arg.arg: expr for arg, expr in zip(args.kwonlyargs, args.kw_defaults, strict=True) if expr}
        if (
            live.__globals__ is not self.namespace
            or code != self.source.codes.get((first, node.name))
            or live.__code__.co_freevars not in ((), ("__class__",))
            or any(_contents(cell) is not owner for cell in live.__closure__ or ())
            or (live.__defaults__ is None) != (not args.defaults)  # None where the source has none, and only there
            or (live.__kwdefaults__ is None) != (not kw)
        ):
            return False
        kwdefaults = live.__kwdefaults__ or {}
        return (
            kwdefaults.keys() == kw.keys()
            and self.is_made(live.__defaults__ or (), ast.Tuple(args.defaults), namespace)
            and all(self.is_made(kwdefaults[name], expr, namespace) for name, expr in kw.items())
        )

    def is_made(self, live: object, expr: ast.expr, namespace: Mapping[str, Any]) -> bool:
        """Whether ``live`` is what a default's or a base's expression makes: a constant (equal, of its type), the
        very object a name or attribute chain names, a tuple of these. Anything else is not."""
        if isinstance(expr, ast.Tuple):
            if type(live) is not tuple or len(live) != len(expr.elts):
                return False
            return all(map(self.is_made, live, expr.elts, repeat(namespace)))
        made = self.made(expr, namespace)
        if made is _MISSING:
            return False
        return live is made if isinstance(expr, ast.Name | ast.Attribute) else type(live) is type(made) and live == made

    def made(self, expr: ast.expr, namespace: Mapping[str, Any]) -> object:
        """What a constant, a negated number, a name or an attribute chain makes; :data:`_MISSING` for the rest."""
        if isinstance(expr, ast.Constant):
            return expr.value
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub) and isinstance(expr.operand, ast.Constant):
            value = expr.operand.value
            return -value if isinstance(value, int | float | complex) else _MISSING
        if isinstance(expr, ast.Name):  # a class body's default reads the class's names, then the module's
            return namespace.get(expr.id, self.namespace.get(expr.id, vars(builtins).get(expr.id, _MISSING)))
        if isinstance(expr, ast.Attribute):
            base = self.made(expr.value, namespace)
            return _MISSING if base is _MISSING else getattr(base, expr.attr, _MISSING)
        return _MISSING


def _contents(cell: Any) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


#: The last judgement, one slot replaced whole (threads read it whole). A cache.
_last: list[_Judgement | None] = [None]
#: name -> the live object last warned of (held, so that a new object never shares an old one's id). A cache.
_warned: dict[str, object] = {}


def unrecognised() -> tuple[str, ...]:
    """What is not recognised now, in :data:`MODULES`' order: a module (its source is no known release's, or it has
    none) or a binding (``module.name``, ``module.Class.name``). Judged again where a live object looked at changed."""
    last = _last[0]
    if last is not None and last.same():
        return last.answer
    judgement = _Judgement()
    _last[0] = judgement if judgement.freeze() else None  # None: something judged is gone already, judged again
    return judgement.answer


def _module_of(name: str) -> str:
    """The module of :data:`MODULES` that ``name`` (a module, or a binding in one) belongs to."""
    return max((module for module in MODULES if name == module or name.startswith(module + ".")), key=len)


def aside() -> dict[str, tuple[str, ...]]:
    """Each thing not recognised now, with the parts that step aside for it (what ``status()`` reports)."""
    return {
        name: tuple(part for part, modules in PARTS.items() if _module_of(name) in modules) for name in unrecognised()
    }


def stepping_aside(part: str) -> bool:
    """Whether ``part`` (of :data:`PARTS`) steps aside now; warns once per live object not recognised."""
    missing = {name: parts for name, parts in aside().items() if part in parts}
    for name, parts in missing.items():
        module = _module_of(name)
        live: object = sys.modules.get(module)  # what ``name`` holds now: the module, or what its namespace binds
        for attr in name.removeprefix(module).split(".")[1:]:
            live = getattr(live, "__dict__", {}).get(attr)
        if _warned.get(name, _warned) is not live:
            _warned[name] = live
            warnings.warn(
                f"torchmetrics_gradpatch: {name} is not recognised (it is not what the source of a release this "
                "package knows makes of it: a newer torchmetrics, or another tool's replacement, wrapper or "
                f"rebinding); the fused sync steps aside from {', '.join(parts)}: torchmetrics' own path "
                "runs there, with this package's gather. status() lists what it steps aside from.",
                RuntimeWarning,
                stacklevel=4,
            )
    return bool(missing)


def forget() -> None:
    """``fused.reset()``'s part: forget which unrecognised objects were warned of (each is warned of again)."""
    _warned.clear()
