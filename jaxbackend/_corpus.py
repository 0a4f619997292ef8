"""The corpus convention: a folder of programs the passes should handle.

A corpus is a folder of Python files. Each file whose name does not start
with `_` or `test_` is imported and must define `CORPUS`, a list of
`Program`s (or of any tuples whose first three items are `name, fn,
make_args`). `make_args()` builds the positional arguments; it runs only
when the program is traced, so importing a corpus file costs nothing but
its definitions. `expect` is the corpus's own business: the corpus tests
read it, `python -m jaxbackend explain --corpus DIR` ignores it.

`variants(...)` makes the two programs every corpus entry comes as: the
forward function, and `value_and_grad` of a scalar loss of it, so the
passes see the code AD writes too.

`load(folder)` returns every program of a folder, in file order; the corpus
tests and `explain --corpus` read the same registry through it. The folder
goes first on `sys.path`, so corpus files can import their `_`-prefixed
helpers (as a script imports its neighbours).
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, NamedTuple

from jaxbackend import _scripts


class Program(NamedTuple):
    name: str
    fn: Callable
    make_args: Callable[[], tuple]
    expect: Any = None


def _loss_of(fn: Callable) -> Callable:
    import jax
    import jax.numpy as jnp

    def loss(*args):
        # The mean square of every output leaf, summed: every output gets a cotangent.
        leaves = jax.tree.leaves(fn(*args))
        return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves)
    return loss


def value_and_grad_of(fn: Callable, argnums=0) -> Callable:
    """`value_and_grad` of a scalar loss of fn's outputs (the mean square of
    each output leaf, summed), with respect to `argnums`."""
    import jax

    grad = jax.value_and_grad(_loss_of(fn), argnums=argnums)
    grad.__name__ = f"{getattr(fn, '__name__', 'fn')}_value_and_grad"
    return grad


def variants(name: str, fn: Callable, make_args: Callable[[], tuple], *, expect,
             expect_grad, argnums=0) -> list[Program]:
    """[forward program, value_and_grad program named `name + ".grad"`]:
    the gradient is taken with respect to `argnums` (the parameters)."""
    return [Program(name, fn, make_args, expect),
            Program(f"{name}.grad", value_and_grad_of(fn, argnums), make_args, expect_grad)]


def corpus_files(folder) -> list[pathlib.Path]:
    """The corpus files of `folder`, sorted by name."""
    return sorted(p for p in pathlib.Path(folder).glob("*.py")
                  if not p.name.startswith(("_", "test_")) and p.name != "conftest.py")


def load(folder) -> list[Program]:
    """Every program of the corpus `folder`, file by file, in order."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise ValueError(f"corpus folder {str(folder)!r} does not exist; give a folder of "
                         f"Python files that each define CORPUS.")
    files = corpus_files(folder)
    if not files:
        raise ValueError(f"corpus folder {str(folder)!r} has no corpus files; add a .py file "
                         f"(not named _* or test_*) that defines CORPUS.")
    out: list[Program] = []
    for path in files:
        module = _scripts.load_module(path, "_jaxbackend_corpus_")
        assert module is not None   # a .py file
        entries = getattr(module, "CORPUS", None)
        if not isinstance(entries, (list, tuple)):
            raise ValueError(f"corpus file {path.name} defines no CORPUS list; add CORPUS = "
                             f"[(name, fn, make_args), ...] (or jaxbackend._corpus.Program).")
        for e in entries:
            out.append(e if isinstance(e, Program) else Program(*e[:3]))
    return out
