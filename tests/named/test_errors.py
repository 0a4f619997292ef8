"""Bad input gets a clear `nx.DimError` (a ValueError), never a wrong answer.

Each test triggers one mistake the issue lists and asserts the exception
type and that the message names the dim, the sizes or dims involved, and the
argument, so a user can fix the call from the message alone.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxbackend import named as nx

X = nx.as_named(np.zeros((2, 3), np.float32), ("batch", "embd"))


def raises(*fragments):
    """pytest.raises(DimError) whose message contains every fragment."""
    class _Ctx:
        def __enter__(self):
            self.ctx = pytest.raises(nx.DimError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self.ctx.__exit__(*exc)
            msg = str(self.info.value)
            assert isinstance(self.info.value, ValueError)
            for f in fragments:
                assert f in msg, f"{f!r} not in message: {msg}"
            return out
    return _Ctx()


def test_dim_error_is_a_value_error():
    assert issubclass(nx.DimError, ValueError)


# -- same dim name, two sizes ---------------------------------------------------

def test_size_conflict_in_arithmetic_names_dim_sizes_and_arguments():
    y = nx.as_named(np.zeros((5,), np.float32), ("embd",))
    with raises("add", "'embd'", "size 3", "size 5", "argument 1", "argument 2",
                "('batch', 'embd')", "('embd',)"):
        X + y


def test_size_conflict_in_where_and_concat():
    cond = nx.as_named(np.ones((4,), bool), ("batch",))
    with raises("where", "'batch'", "2", "4"):
        nx.where(cond, X, 0.0)
    y = nx.as_named(np.zeros((2, 4), np.float32), ("batch", "embd"))
    with raises("concat", "'embd'", "3", "4", "array 1", "array 2"):
        nx.concat([X, y], "batch")


def test_size_conflict_in_dot_names_operands():
    w = nx.as_named(np.zeros((4, 7), np.float32), ("embd", "head"))
    with raises("dot", "'embd'", "size 3", "size 4", "argument 1", "argument 2"):
        nx.dot(X, w, dim="embd")
    ok = nx.as_named(np.zeros((3, 7), np.float32), ("embd", "head"))
    bad = nx.as_named(np.zeros((8,), np.float32), ("head",))
    with raises("dot", "'head'", "size 7", "size 8", "argument 3"):
        nx.dot(X, ok, bad, dim=None)


# -- unknown dims (list the dims that exist) ----------------------------------------

@pytest.mark.parametrize("op,call", [
    ("isel", lambda: X.isel(time=0)),
    ("rename", lambda: X.rename(time="t")),
    ("sum", lambda: X.sum(dim="time")),
    ("mean", lambda: X.mean(dim=("batch", "time"))),
    ("dot", lambda: nx.dot(X, X, dim="time")),
    ("softmax", lambda: nx.softmax(X, "time")),
    ("einsum", lambda: nx.einsum(X, X, out=("time",))),
    ("log_softmax", lambda: nx.log_softmax(X, "time")),
    ("logsumexp", lambda: nx.logsumexp(X, "time")),
    ("transpose", lambda: X.transpose("time", ...)),
    ("squeeze", lambda: X.squeeze("time")),
    ("stack", lambda: nx.stack(X, m=("batch", "time"))),
    ("unstack", lambda: nx.unstack(X, time={"a": 1})),
])
def test_unknown_dim_lists_existing_dims(op, call):
    with raises(f"{op}:", "'time'", "('batch', 'embd')"):
        call()


def test_bare_string_as_reduction_dim_is_one_name_not_letters():
    # "be" must not be read as dims ("b", "e"): it is one (unknown) name.
    with raises("sum", "'be'", "('batch', 'embd')"):
        X.sum(dim="be")


# -- duplicate names, bare strings, rank ---------------------------------------------

def test_duplicate_dim_names():
    with raises("as_named", "'a'", "twice"):
        nx.as_named(np.zeros((2, 2)), ("a", "a"))
    with raises("rename", "'embd'", "'batch'", "already"):
        X.rename(embd="batch")
    with raises("transpose", "'batch'", "twice"):
        X.transpose("batch", "batch")
    with raises("unstack", "'batch'", "twice"):
        nx.unstack(X, embd={"batch": 3, "x": 1})
    with raises("expand_dims", "'batch'", "twice"):
        X.expand_dims("batch")


def test_bare_string_dims_do_not_become_letters():
    # Three axes and a 3-letter string: must raise, not silently name a, b, c.
    with raises("as_named", "dims='abc'", "('abc',)"):
        nx.as_named(np.zeros((1, 1, 1)), "abc")
    with raises("as_named", "dims='abc'"):
        nx.as_named(np.zeros((3,)), "abc")
    with raises("stack", "m='ab'"):
        nx.stack(nx.as_named(np.zeros((1, 1)), ("a", "b")), m="ab")


def test_rank_and_dims_length_disagree():
    with raises("as_named", "2 axes", "(2, 3)", "('batch',)", "names 1"):
        nx.as_named(np.zeros((2, 3)), ("batch",))
    with raises("as_named", "2 axes", "('a', 'b', 'c')", "names 3"):
        nx.as_named(np.zeros((2, 3)), ("a", "b", "c"))


def test_dims_that_are_not_strings():
    with raises("as_named", "0", "str"):
        nx.as_named(np.zeros((2,)), (0,))


def test_unstack_sizes_must_multiply_to_the_dim_size():
    with raises("unstack", "'embd'", "size 3", "{'head': 2, 'hd': 2}", "multiply to 4"):
        nx.unstack(X, embd={"head": 2, "hd": 2})


def test_squeeze_of_a_dim_that_is_not_size_one():
    with raises("squeeze", "'embd'", "size 3", ".isel(embd=0)"):
        X.squeeze("embd")


def test_unnamed_array_operand():
    with raises("add", "argument 2", "(2, 3)", "nx.as_named"):
        X + np.zeros((2, 3), np.float32)


def test_transpose_missing_dims():
    with raises("transpose", "('embd',)", "..."):
        X.transpose("batch")


def test_positional_getitem_is_refused():
    with raises("isel", "0"):
        X[0]


def test_values_whose_rank_lost_an_axis_are_caught():
    # jax.vmap over a NamedArray strips a leading axis from the leaf but not
    # from the dims (static data): ops must refuse instead of mis-reading axes.
    def f(x):
        return x.sum(dim="batch").values

    with raises("sum", "1 axes", "('batch', 'embd')", "vmap"):
        jax.vmap(f)(X)


def test_messages_end_with_a_fix():
    # Every message is one or two sentences ending in a fix, never a bare repr.
    msgs = []
    for call in (lambda: X.sum("q"), lambda: nx.as_named(np.zeros(2), "ab"),
                 lambda: nx.unstack(X, embd={"a": 2})):
        try:
            call()
        except nx.DimError as e:
            msgs.append(str(e))
    assert len(msgs) == 3
    for m in msgs:
        assert re.search(r"; [a-z].*\.$", m), m
