from collections.abc import Sequence
from typing import Any, TypeAlias

from jaxtyping import ArrayLike


# The entry points check their inputs' structure themselves, so that an error names
# the argument and the shape it needs: jaxtyping shapes are on the pieces, which see
# arrays only.
InputArray: TypeAlias = ArrayLike | Sequence[Any]
"""What the entry points of speculax ([`speculax.speculative_step`][], the steps'
`__call__`, [`speculax.diagnose`][], [`speculax.sharded_step`][]'s function, the
loop) take for an array: a JAX array, a NumPy array, a Python or NumPy scalar, or
nested Python lists or tuples of numbers, such as `[[3, 2]]`.

Each argument's documentation gives the shape and the dtype it needs; the entry
point checks them when it is called (or traced) and raises a `ValueError` or
`TypeError` naming the argument. Inside, every input is a JAX array.
"""
