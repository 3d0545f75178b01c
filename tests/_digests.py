"""One function's recognition digest (``recognise``'s canonical digest of one ``def``), live or from its module's
source: the tests compare the two to check what the digest leaves out. Standard library only: the probe loads it by
its path beside ``recognise.py``, under every Python.
"""

from __future__ import annotations

import ast
import inspect
import tokenize
from types import FunctionType, ModuleType

#: :func:`digest_in_module`'s answer for an attribute its module's source does not define.
ABSENT = "absent"


def digest(recognise: ModuleType, fn: object) -> str | None:
    """The canonical digest of plain function ``fn``'s own source (its decorators part of it); ``None`` where it has
    none."""
    if type(fn) is not FunctionType:  # exactly: a proxy (wrapt) passes isinstance and forwards __code__
        return None
    try:
        source = inspect.getsource(fn.__code__)
        # an indented def parses as the body of ``if 1:`` exactly as within its module (textwrap.dedent would change
        # multi-line strings and fail on lines less indented than the def)
        wrapped = source[:1].isspace()
        body = ast.parse("if 1:\n" + source if wrapped else source).body
    except (OSError, TypeError, SyntaxError, ValueError, tokenize.TokenError):
        return None
    if wrapped and len(body) == 1 and isinstance(body[0], ast.If):
        body = body[0].body
    if len(body) != 1 or not isinstance(body[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    return recognise._digest_node(body[0])


def _binding(statements: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of ``statements`` that is the one binding of ``name`` in that scope (``None``: there is none).
    Raises ``LookupError`` where the source alone cannot settle which object the name holds."""
    found: list[ast.stmt | None] = []  # None: a binding that is not a statement of ``statements`` defining it
    todo: list[tuple[ast.AST, bool]] = [(stmt, True) for stmt in statements]
    while todo:
        node, top = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
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


def digest_in_module(recognise: ModuleType, source: str, owner: str | None, name: str) -> str:
    """The digest of ``owner.name`` (``owner`` a class; ``None``: module level) from the module's ``source``;
    :data:`ABSENT` where it is not there. Raises ``LookupError`` where it is bound otherwise than by one ``def``."""
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
    return recognise._digest_node(node)
