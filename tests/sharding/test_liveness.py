"""The memory model's placement of temporaries (`_liveness`): a scan holds
its operands to its last trip and its stacked results from its first, and
temporaries that fit go into result buffers not yet written, checked
against XLA's `memory_analysis` on small programs and on `packed_peak`'s
own rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxbackend.sharding._liveness import Liveness, packed_peak
from tests.sharding.test_cost_terms import _unsharded_cost


def _predicted(fn, *args) -> float:
    return _unsharded_cost(fn, *args).memory   # memory does not depend on the profile


def _measured(fn, *args) -> int:
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def _residuals_then_result(p, a, xs):
    """A forward scan stacks its results (residuals), a second scan reads
    them, and the step's result is written after both."""
    def body(c, x):
        y = jnp.sin(c @ x)
        return y, y

    _, ys = lax.scan(body, a, xs)
    s, _ = lax.scan(lambda c, y: (c + jnp.cos(y).sum(), None), 0.0, ys)
    return p * s


@pytest.mark.parametrize("rows", [8 * 64, 64])
def test_stacked_residuals_go_into_a_result_buffer_they_fit(rows):
    # rows 512: the result is as large as the stacked residuals, which XLA
    # keeps in the result's buffer until it is written (the model without
    # that placement said 21% too much); rows 64: too small to hold them
    n, layers = 64, 8
    args = (jnp.ones((rows, n)), jnp.ones((n, n)), jnp.ones((layers, n, n)))
    assert _predicted(_residuals_then_result, *args) == pytest.approx(
        _measured(_residuals_then_result, *args), rel=0.1)


def _read_slice_by_slice(w, xs):
    """A temporary (sin of the input) that a scan reads one slice per trip,
    while the scan stacks results of the same size."""
    xs = jnp.sin(xs)
    _, ys = lax.scan(lambda c, x: (c, jnp.cos(x @ w)), 0.0, xs)
    return ys.max()


def test_a_scans_operands_are_held_for_the_whole_loop():
    # to XLA the scan is a `while` holding all of xs to the last trip, so
    # xs and the growing stack of results are live together; the model had
    # xs fused into the per-trip slice and then dead (37% under), and the
    # stack live only after the loop
    args = (jnp.ones((64, 64)), jnp.ones((8, 64, 64)))
    assert _predicted(_read_slice_by_slice, *args) == pytest.approx(
        _measured(_read_slice_by_slice, *args), rel=0.1)


def _lv(temps, results):
    return Liveness([], [], np.zeros((1, 0)), temps, results)


def test_packed_peak_places_a_temporary_only_where_it_fits_in_time_and_size():
    fixed = [16.0, 8.0]            # two result buffers
    live = [16.0, 4.0]             # two temporary groups
    # a 16-byte temporary dead (op 5) before the 16-byte result is written (op 9)
    assert packed_peak(_lv([(0, 0, 5)], [(0, 9)]), live, fixed) == 0.0
    # written while the temporary is still read: no room
    assert packed_peak(_lv([(0, 0, 5)], [(0, 5)]), live, fixed) == 16.0
    # only the 8-byte result is free: too small for it
    assert packed_peak(_lv([(0, 0, 5)], [(1, 9)]), live, fixed) == 16.0
    # two temporaries live at once share no buffer: the larger one is
    # placed, the smaller one stays on the heap
    assert packed_peak(_lv([(1, 0, 5), (0, 2, 4)], [(0, 9)]), live, fixed) == 4.0
    # one after the other, both fit in the one buffer
    assert packed_peak(_lv([(1, 0, 1), (0, 2, 4)], [(0, 9)]), live, fixed) == 0.0
