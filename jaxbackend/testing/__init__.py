"""Equivalence helpers for users' own pytest suites, and the one numeric
comparison the project's own tests use.

* `assert_close(actual, expected, *, rtol, atol, scale, check_dtype, what)`:
  values (arrays or pytrees of them) agree within the error model below.
* `abs_scale(fn, *args)`: the `scale` of fn's outputs: the sum of |terms|
  of a sum or contraction, carried through any program.
* `assert_modules_match(named, reference, to_reference, inputs)`: a named
  module (NamedArrays in, NamedArray out) against a positional reference
  (say, written with `nnx.Linear`) on the SAME weights. `to_reference` maps
  the named module's parameters (a pure dict, as `nnx.to_pure_dict` gives)
  to the reference's; it must be differentiable (reshapes, transposes), so
  both modules become functions of the same parameters and their gradients
  are compared leaf by leaf, with the parameter path in any failure.
* `assert_pass_preserves(pass_fn, fn, *args)`: any `ClosedJaxpr ->
  ClosedJaxpr` callable (a `jaxbackend.passes` pass or pipeline, or your
  own) keeps fn's input/output types, still type-checks, computes the same
  values and the same gradients, and (optionally) is idempotent.
* `check_pass(pass_fn, fn, args)`: the stricter checks the project's own
  pass tests use, for a scalar `fn`: the pass also runs on the
  `value_and_grad` jaxpr, and the rewritten forward jaxpr differentiates
  like `fn` (`assert_same_values` compares two ClosedJaxprs).

Failures raise `AssertionError` naming the leaf and the worst entry; success
returns the max abs error (or a small report dict).

Error model
-----------
The two compared values are one mathematical expression evaluated by two
float programs (`jb.jit` vs `jax.jit`, rolled vs unrolled layers, one CPU vs
another, sharded vs not). They may differ in association (a sum split over
vector lanes, scan steps or devices and added in another order), in fusion
(an FMA instead of a rounded multiply and add; an intermediate kept in
float32 instead of rounded to bfloat16) and in the code of transcendental
functions (vector and scalar paths of XLA's exp/tanh/log differ by an ulp or
two). Let eps be the dtype's machine epsilon (`EPS`: 2**-52 float64, 2**-23
float32, 2**-7 bfloat16, 2**-10 float16) and u = eps/2 the unit roundoff.

1. One op: a correctly rounded op is within u of its result, relative
   (XLA's exp/tanh/log: within a few ulps).
2. One sum: a sum of n terms t_i, in ANY order, is within (n-1) u sum|t_i|
   of the exact sum (Higham, "Accuracy and Stability of Numerical
   Algorithms", 2nd ed., eq. 4.4); a contraction sum_k a_k b_k likewise with
   sum_k |a_k b_k|. The bound is relative to sum|t_i|, NOT to |sum t_i|: a
   loss of 512 O(1) terms that comes to -0.47 differed by 7e-5 (1.6e-4 of
   itself) between two CPUs, which is 2 eps of sum|t_i|. So the comparison
   is `|actual - expected| <= atol + rtol * scale` entry by entry, with
   `scale` the sum of |terms| the entry came from.
3. The factor: the worst case (n-1) u is not the typical one. Round-to-
   nearest errors are zero-mean and nearly independent (Higham and Mary,
   SIAM J. Sci. Comput. 41(5), 2019), and XLA reduces with w >= 4 vector
   accumulators and then a tree, so one evaluation errs by about
   u sqrt(m/3) sum|t_i| (one standard deviation; m = n/w + log2 w additions
   per chain, partial sums at most sum|t_i|, their root mean square
   sum|t_i|/sqrt 3). For the sums tests do (n <= 4096: m <= 1026) that is
   <= 9.3 eps; two evaluations differ by <= 13 eps (sqrt 2 times), and by
   more than 4 standard deviations, 52 eps, essentially never. Hence
   `ROUNDINGS = 64` for float32 and float64 (float64 accumulates in float64:
   the same factor): rtol 7.6e-6 and 1.4e-14.
4. float16 and bfloat16 are not accumulated in their own precision: jnp's
   sums, means and dots upcast them to float32, and XLA CPU evaluates their
   elementwise ops in float32 and rounds each result. What differs between
   two programs is where results are rounded to the short mantissa (a fused
   chain may skip a rounding): at most one rounding per op. The factor is
   4 eps = 8 roundings of u, a chain of up to 8 ops (a layer norm or a
   softmax is about that): rtol 3.1e-2 (bfloat16), 3.9e-3 (float16); the
   float32 accumulation underneath is 2**16 (2**13) times finer.
5. Integers and bools are exact: compared with `==`. The non-finite pattern
   (positions of nan, +inf and -inf) is compared exactly too: a program that
   turns inf into nan, or a finite value into inf, is wrong, not inexact.
   Complex values are points of the plane: the error is |actual - expected|
   (both parts), at the tolerance of their parts' float dtype; in
   `abs_scale` an FFT's output sums its transformed axes' |inputs|.
6. Programs: `abs_scale(fn, *args)` carries 2. through a whole program:
   each operation's own rounding (its sum|terms|, or |result| for an
   elementwise op) reaches the outputs times |derivative|, and the
   contributions add in quadrature as in 3. One sum gets exactly sum|terms|,
   so rtol means the same for a program as for one sum. Each op's rounding
   counts at its own dtype's u, expressed in the output dtype's: a float32
   loss computed through bfloat16 matmuls (mixed precision) carries their
   roundings, each 2**16 float32 ones, and is compared at float32's rtol
   against that larger scale; float32 work under a bfloat16 result counts
   at its own, 2**16 times finer, size. A product of two
   values that both carry errors (or a power of one) also gets the product
   of the errors, the second-order term (variance u**2 w0 w1 in units of
   u**2): negligible unless the values are themselves rounding noise, where
   it is the whole error (AdamW's second moment of a gradient that cancels
   by symmetry, a key bias's: 1e-21 against 3e-21 between two programs,
   which the first-order model gave a scale of 0).

`TOLERANCES[dtype] = (ROUNDINGS[dtype] * EPS[dtype], 0)`; the loosest dtype
of the two compared arrays wins (a bfloat16 result against a float32
reference is compared at bfloat16's). `atol` is 0: an absolute floor would
hide errors in small tensors. One exception, against a numpy reference only:
XLA:CPU flushes subnormal results to 0 where numpy keeps them, so a value
below the smallest normal may move by itself (`atol=np.finfo(np.float32).tiny`;
the project's xarray comparisons pass it).

`scale` defaults to max|expected| over the tensor (its finite entries): the
right scale for entries made of terms no larger than the tensor's largest
entry (activations, logits, most weight gradients). It is the wrong one for
entries that cancel: a scalar loss summing signed terms, a gradient that is
~0 by symmetry, a matmul with tiny results from O(1) operands. Those pass
`scale=abs_scale(fn, *args)` (fn: the reference computation), or
`scale=lambda: abs_scale(fn, *args)`, which tries the default first and pays
for the scale's compile only where the default fails. A tolerance below this
model is a defect; one far above it hides bugs: tests pick a scale, not an
rtol.

Modules: `_close` (tolerances, `assert_close`), `_scale` (`abs_scale`),
`_modules` (`assert_modules_match`), `_passes` (pass checks).
"""

from jaxbackend.testing._close import EPS as EPS
from jaxbackend.testing._close import ROUNDINGS as ROUNDINGS
from jaxbackend.testing._close import TOLERANCES as TOLERANCES
from jaxbackend.testing._close import assert_close as assert_close
from jaxbackend.testing._close import tolerance as tolerance
from jaxbackend.testing._modules import assert_modules_match as assert_modules_match
from jaxbackend.testing._passes import assert_pass_preserves as assert_pass_preserves
from jaxbackend.testing._passes import assert_same_values as assert_same_values
from jaxbackend.testing._passes import check_pass as check_pass
from jaxbackend.testing._scale import abs_scale as abs_scale

__all__ = ["EPS", "ROUNDINGS", "TOLERANCES", "abs_scale", "assert_close", "assert_modules_match",
           "assert_pass_preserves", "assert_same_values", "check_pass", "tolerance"]
