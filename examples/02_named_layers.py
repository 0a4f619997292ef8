"""02 · Named Flax NNX layers, checked against a positional Flax module.

A named MLP (embd -> mlp -> embd) and the same MLP written with
`nnx.Linear`; `jaxbackend.testing.assert_modules_match` checks outputs and
every parameter gradient on shared weights. Then the parameter dims turn
sharding rules into PartitionSpecs and Flax logical axis rules.

Run: python examples/02_named_layers.py [--tiny]
"""

import argparse

import jax
from flax import nnx

from jaxbackend import named as nx
from jaxbackend import nn, testing


class PlainMLP(nnx.Module):
    def __init__(self, embd, hidden, rngs):
        self.up = nnx.Linear(embd, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, embd, rngs=rngs)

    def __call__(self, x):  # x: (batch, time, embd)
        return self.down(jax.nn.gelu(self.up(x)))


def main(tiny: bool) -> None:
    embd, hidden, b, t = (8, 16, 2, 4) if tiny else (128, 512, 8, 64)
    named = nn.MLP(embd, hidden, rngs=nnx.Rngs(0))
    plain = PlainMLP(embd, hidden, nnx.Rngs(1))
    x = nx.as_named(jax.random.normal(jax.random.key(2), (b, t, embd)), ("batch", "time", "embd"))
    # Same parameter layout here, so the weight map is the identity.
    report = testing.assert_modules_match(named, plain, lambda p: p, (x,),
                                          reference_inputs=(x.values,))
    print(f"outputs agree (max abs err {report['out_err']:.2e}); gradients agree for "
          f"{len(report['grad_err'])} parameters")

    print("parameter dims:", {k: v for k, v in _flat(nn.param_dims(named)).items()})
    rules = {"batch": "data", "mlp": "model"}
    specs = nn.partition_specs(named, rules)
    print("PartitionSpecs under", rules, "->", _flat(specs))
    print("as Flax logical axis rules:", nn.flax_logical_axis_rules(rules, named))


def _flat(tree):
    leaves = jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda v: isinstance(v, (tuple, jax.sharding.PartitionSpec)))
    return {jax.tree_util.keystr(p): v for p, v in leaves}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small sizes (tests)")
    main(ap.parse_args().tiny)
