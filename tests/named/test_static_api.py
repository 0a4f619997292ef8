"""The named API is visible without running it: every NamedArray method is
written in the class body and every `nx` function is a module-level import
of `jaxbackend.named`, so go-to-definition and type checkers find them."""

import ast
import inspect

import jaxbackend.named as nx
from jaxbackend.named import _array


def _class_body_names() -> set:
    tree = ast.parse(inspect.getsource(_array))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NamedArray")
    names = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_every_method_is_declared_in_the_class_body():
    declared = _class_body_names()
    attached = {k for k, v in vars(nx.NamedArray).items()
                if (callable(v) or isinstance(v, (property, classmethod))) and k not in declared}
    assert attached == set()
    for name in ("rename", "isel", "transpose", "stack", "unstack", "sum", "take", "__add__",
                 "__rtruediv__", "__ge__", "__matmul__", "__getitem__", "__setitem__"):
        assert name in declared, name


def test_every_public_function_is_a_static_import():
    tree = ast.parse(inspect.getsource(nx))
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                for a in n.names}
    assert set(nx.__all__) <= imported
    assert {"exp", "silu", "gelu", "rsqrt", "square", "maximum", "sum", "logsumexp"} <= imported
    public = {k for k in vars(nx) if not k.startswith("_")}
    assert public == set(nx.__all__)
