"""Test doubles shared by several test files."""

from typing import ClassVar

import equinox as eqx

import speculax


class DelegatingResidual(speculax.AbstractResidual):
    """A residual's weights, from a piece the step does not know: the step runs it
    on the generic path, the sampler reading the weights as a `(batch, vocab)`
    array, which must agree with the fused path of the residual inside (by default
    `Residual`). Splits the vocabulary where its inner residual does."""

    reads_draft_probs: ClassVar[bool] = True
    inner: speculax.Residual | speculax.BlockResidual = speculax.Residual()

    @property
    def axis_name(self) -> str | None:
        return self.inner.axis_name

    def __call__(
        self, num_accepted, draft_tokens, draft_probs, target_probs, *, num_draft_tokens
    ):
        return self.inner(
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            num_draft_tokens=num_draft_tokens,
        )


class BlockSumsOnly(speculax.AbstractBlockSumSampler):
    """A sampler of its own that draws only from block sums: as `InverseCDF` with
    blocks of 8, and raising where a step hands it the residual's weights."""

    reads_uniforms: ClassVar[bool] = True
    block_size: int = eqx.field(static=True, default=8)
    axis_name: None = eqx.field(static=True, default=None, init=False)

    def __call__(self, weights, sample_uniforms):
        raise AssertionError("drawn from the weights")

    def draw_from_block_sums(self, *args):
        return speculax.InverseCDF(self.block_size).draw_from_block_sums(*args)
