import abc
from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


class AbstractPrefixCount(eqx.Module):
    """Turns per-position verdicts into the number of accepted draft tokens.

    Subclass it and implement `__call__` to write your own rule; plug it into
    [`speculax.SpeculativeStep`][] with `SpeculativeStep(prefix=...)`. The concrete
    counts are final: to change one, wrap it in a piece of your own.
    """

    @abc.abstractmethod
    def __call__(self, passed: Bool[Array, "batch draft"]) -> Int[Array, " batch"]:
        """**Arguments:**

        - `passed`: whether each position's acceptance test passed.

        **Returns:**

        An int32 array of shape `(batch,)`, each entry in `[0, draft]`.
        """


@final
class PrefixCount(AbstractPrefixCount):
    """Counts the tests passed before the first failure: $n$ is the length of the
    leading run of `True` in each row, or `draft` when every test passes.
    """

    def __call__(self, passed: Bool[Array, "batch draft"]) -> Int[Array, " batch"]:
        # The first failing position, or `draft` where none fails: one reduction
        # where a cumulative product would take a scan.
        num_draft = passed.shape[-1]
        position = jnp.arange(num_draft, dtype=jnp.int32)
        return jnp.min(
            jnp.where(passed, num_draft, position), axis=-1, initial=num_draft
        )


@final
class LastPassCount(AbstractPrefixCount):
    """Counts up to the last pass: $n$ is one more than the last position whose test
    passed, or 0 when none did. The count of block verification (see
    [`speculax.BlockAcceptance`][]), where a pass keeps the drafts before it whatever
    their own verdicts; beside [`speculax.RatioAcceptance`][] it is **not
    lossless**.
    """

    def __call__(self, passed: Bool[Array, "batch draft"]) -> Int[Array, " batch"]:
        num_draft = passed.shape[-1]
        position = jnp.arange(1, num_draft + 1, dtype=jnp.int32)
        return jnp.max(jnp.where(passed, position, 0), axis=-1, initial=0)
