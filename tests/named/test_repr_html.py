"""`NamedArray._repr_html_`: dims, sizes and dtype; the mesh axes of each
dim of a sharded array (8 simulated devices); a value preview for small
concrete arrays; and it never raises, whatever the leaf holds."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxbackend import named as nx
from jaxbackend import sharding
from jaxbackend.named import _display
from tests._html_tables import read


def _dims_table(x):
    page = read(x._repr_html_())
    assert len(page.tables) == 1, page.tables
    return page, page.tables[0]


def test_table_lists_each_dim_with_its_size_in_order():
    x = nx.as_named(jnp.zeros((2, 3, 5)), ("batch", "time", "embd"))
    page, t = _dims_table(x)
    assert t.header == ["dim", "size"]
    assert t.rows == [["batch", "2"], ["time", "3"], ["embd", "5"]]
    assert page.title == "NamedArray · float32 · 3-d"


def test_dim_names_are_escaped():
    name = '<img src=x onerror="alert(1)">&amp;'
    x = nx.as_named(jnp.zeros((2, 3)), (name, "b"))
    html = x._repr_html_()
    assert "<img" not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;amp;" in html
    _, t = _dims_table(x)
    assert t.rows[0] == [name, "2"]          # the reader decodes it back to the name as written
    assert "img" not in read(html).tags


def test_sharded_dims_show_their_mesh_axes_and_per_device_size():
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    x = nx.as_named(jax.device_put(jnp.ones((4, 8, 3)), NamedSharding(mesh, P("data", "model"))),
                    ("batch", "embd", "k"))
    page, t = _dims_table(x)
    assert t.header == ["dim", "size", "mesh axes", "per device"]
    assert t.rows == [["batch", "4", "data", "2"], ["embd", "8", "model", "2"],
                      ["k", "3", "replicated", "3"]]
    assert "on a mesh (data=2, model=4) of 8 devices" in page.notes


def test_a_dim_split_over_two_mesh_axes_names_both():
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    x = nx.as_named(jax.device_put(jnp.ones((16, 3)), NamedSharding(mesh, P(("data", "model")))),
                    ("batch", "k"))
    _, t = _dims_table(x)
    assert t.column("mesh axes") == {"batch": "data × model", "k": "replicated"}
    assert t.column("per device") == {"batch": "2", "k": "3"}


def test_small_arrays_preview_their_values():
    x = nx.as_named(jnp.arange(6.0).reshape(2, 3), ("a", "b"))
    page, _ = _dims_table(x)
    assert page.pre == ["[[0. 1. 2.]\n [3. 4. 5.]]"]


def test_large_arrays_are_not_copied_for_a_preview():
    n = _display.PREVIEW_MAX + 1
    page, _ = _dims_table(nx.as_named(jnp.zeros((n,)), ("a",)))
    assert page.pre == [] and any("no preview" in s for s in page.notes)


def test_tracer_inside_jit_shows_dims_and_no_values():
    seen = []

    @jax.jit
    def f(x):
        seen.append(x._repr_html_())
        return x

    f(nx.as_named(jnp.ones((2, 3), jnp.bfloat16), ("batch", "embd")))
    page = read(seen[0])
    assert page.tables[0].rows == [["batch", "2"], ["embd", "3"]]
    assert page.title == "NamedArray · bfloat16 · 2-d"
    assert page.pre == [] and any("traced" in s for s in page.notes)


def test_bfloat16_array_previews_its_values():
    x = nx.as_named(jnp.asarray([[1.5, -2.0]], jnp.bfloat16), ("a", "b"))
    page, _ = _dims_table(x)
    assert page.title == "NamedArray · bfloat16 · 2-d"
    assert page.pre == ["[[ 1.5 -2. ]]"]


def test_0d_array_shows_its_value_and_no_dims_table():
    page = read(nx.as_named(jnp.float32(3.25), ())._repr_html_())
    assert page.tables == [] and page.pre == ["3.25"]
    assert page.title == "NamedArray · float32 · 0-d (a scalar)"


def test_donated_buffer_shows_shape_without_reading_it():
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    v = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "model")))
    x = nx.as_named(v, ("batch", "embd"))
    jax.jit(lambda a: a * 2, donate_argnums=0)(v)
    assert v.is_deleted()     # the CPU backend honours donation
    page, t = _dims_table(x)
    assert t.column("mesh axes") == {"batch": "replicated", "embd": "model"}
    assert page.pre == [] and any("deleted" in s for s in page.notes)


@pytest.mark.parametrize("leaf, note", [
    (None, "no array here: the leaf is NoneType"),
    (jax.ShapeDtypeStruct((2, 3), jnp.float32), "abstract (ShapeDtypeStruct): no values"),
], ids=["none", "shape_dtype_struct"])
def test_placeholder_leaves_render(leaf, note):
    # JAX and Flax rebuild NamedArrays around such leaves; unflattening never validates.
    page = read(nx.NamedArray(leaf, ("a", "b"))._repr_html_())
    assert note in page.notes and page.pre == []
    assert [r[0] for r in page.tables[0].rows] == ["a", "b"]


def test_key_arrays_have_no_numeric_preview():
    page, t = _dims_table(nx.NamedArray(jax.random.split(jax.random.key(0), 3), ("k",)))
    assert t.rows == [["k", "3"]] and page.pre == []
    assert any("no numeric preview" in s for s in page.notes)


def test_dims_that_disagree_with_the_leaf_rank_render():
    page, t = _dims_table(nx.NamedArray(jnp.ones((2, 3)), ("a",)))
    assert t.rows == [["a", "?"]] and any("do not match" in s for s in page.notes)


def test_ipython_picks_up_the_html():
    formatters = pytest.importorskip("IPython.core.formatters")
    x = nx.as_named(jnp.ones((2,)), ("a",))
    assert formatters.HTMLFormatter()(x) == x._repr_html_()
