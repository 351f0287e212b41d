"""Exact checks that a composition of pieces is lossless.

A [`speculax.SpeculativeStep`][] is lossless when, with every draft token $x_i$ drawn
from $q_i$ and the uniforms independent and uniform, token $k$ of its output, given
$n \\ge k$, is distributed exactly as $p_k$. For one row with a small vocabulary and a
few draft positions this can be computed exactly rather than sampled:
[`speculax.testing.output_distribution`][] enumerates every draft sequence and
integrates over the uniforms analytically, evaluating each of the step's own pieces,
sampler included, and [`speculax.testing.lossless_error`][] turns the result into one
number. Use them to check a custom acceptance, prefix, residual or sampler piece. A
piece whose dependence on its uniform cannot be integrated this way (an acceptance
test that is not monotone in its own uniform, a sampler that draws a token on more
than one interval of its uniform) is refused with an error that names it; test it
with [`speculax.testing.lossless_chi_square`][], a chi-square test of the compiled
step.

**How strong the check is.** What is computed exactly is the law of the rule each
piece is found to follow: the threshold of each acceptance test and the interval of
each sampler's token, found by bisection to the last bit of float64. Whether the
piece follows that rule everywhere is checked at 1024 uniforms for every row and
position, spread from a shift drawn afresh at every call, which leave no gap wider
than $1.2 \\cdot 10^{-3}$ in $[0, 1)$ wherever the shift falls: a piece that departs
from its rule on any interval of its uniform wider than that is refused, never
called lossless, and what a narrower departure may hide moves a probability by less
than the interval's width. The chain checkers take a
[`speculax.SpeculativeStep`][] only, and the tree checkers the library's two tree
steps, refusing any other by name; the loop checker evaluates a
[`speculax.LogitsStep`][] by the rule it states, and cannot vouch for a key schedule
whose reuse of a random number depends on the row's key.
[`speculax.testing.tree_output_distribution`][] and
[`speculax.testing.tree_lossless_error`][] do the same for a
[`speculax.TreeStep`][] over every draft tree of a given shape.
[`speculax.testing.loop_output_distribution`][] and
[`speculax.testing.loop_lossless_error`][] check a whole
[`speculax.SpeculativeLoop`][], its key schedule included, over many steps, against
[`speculax.testing.target_output_distribution`][], the target sampled one token at a
time.

**Example:**

```python
import numpy as np
import speculax
import speculax.testing

draft_probs = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
target_probs = np.array([[0.2, 0.2, 0.6], [0.3, 0.3, 0.4], [1.0, 0.0, 0.0]])
error = speculax.testing.lossless_error(
    speculax.SpeculativeStep(), draft_probs, target_probs
)
assert error < 1e-12
```
"""

from ._chain import (
    OutputDistribution as OutputDistribution,
    lossless_error as lossless_error,
    output_distribution as output_distribution,
)
from ._loop import (
    loop_lossless_error as loop_lossless_error,
    loop_output_distribution as loop_output_distribution,
    target_output_distribution as target_output_distribution,
)
from ._statistical import (
    ChiSquareTest as ChiSquareTest,
    lossless_chi_square as lossless_chi_square,
)
from ._tree import (
    Drafting as Drafting,
    Model as Model,
    tree_lossless_error as tree_lossless_error,
    tree_output_distribution as tree_output_distribution,
)
