from typing import TypedDict

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._core._failures import (
    RESULTS,
    first_failure,
    input_failures,
    report_failures,
    sampled_failure,
)
from .._core._numerics import index_array
from .._core._vocab_axis import full_vocab
from .._inputs._coercion import (
    coerce_inputs,
    optional_array,
    optional_index_array,
    uniform_reader,
)
from .._inputs._input_array import InputArray
from .._inputs._random import KeyArray
from .._pieces._acceptance import (
    AbstractAcceptance,
    BlockAcceptance,
    GreedyAcceptance,
    RatioAcceptance,
)
from .._pieces._prefix import AbstractPrefixCount, LastPassCount, PrefixCount
from .._pieces._residual import AbstractResidual, BlockResidual, Residual, TargetRow
from .._pieces._sampling import AbstractSampler, Argmax, InverseCDF
from ._draw import draw_token


class StepOutput(TypedDict):
    """What one verification step returns: a plain `dict` with exactly these two keys,
    the problem statement's output.

    - `num_accepted`: int32 array of shape `(batch,)`, the number $n$ of accepted draft
        tokens per row.
    - `tokens`: int32 array of shape `(batch, draft + 1)`; row $b$ holds the $n$
        accepted draft tokens, then the drawn token $y$, then `-1` in every remaining
        position.

    Each row's outcome (a [`speculax.RESULTS`][] item) is not among the keys: a
    step's `with_result` returns it beside this dict (see
    [`speculax.SpeculativeStep.with_result`][]).
    """

    num_accepted: Int[Array, " batch"]
    tokens: Int[Array, "batch draft+1"]


class SpeculativeStep(eqx.Module):
    """One verification step of speculative decoding, assembled from four pieces.

    Draft token $x_i$ passes when $u_i < p_i(x_i) / q_i(x_i)$; $n$ counts the tests
    passed before the first failure; one more token $y$ is drawn at position $n$ from
    $r \\propto \\max(p_n - q_n, 0)$ (or from $p_G$ when every draft passed) by inverse
    CDF with uniform $s$. If every $x_i$ was drawn from $q_i$, token $k$ of the output
    (given $n \\ge k$) is distributed exactly as $p_k$.

    Each piece is a field and can be swapped, through the constructor or with
    `eqx.tree_at(lambda s: s.acceptance, step, MyAcceptance())`.

    **Arguments:**

    The constructor takes the four pieces, each optional, and three keyword-only
    flags:

    - `acceptance`: a [`speculax.AbstractAcceptance`][]; default
        [`speculax.RatioAcceptance`][].
    - `prefix`: a [`speculax.AbstractPrefixCount`][]; default
        [`speculax.PrefixCount`][].
    - `residual`: a [`speculax.AbstractResidual`][]; default [`speculax.Residual`][].
    - `sampler`: a [`speculax.AbstractSampler`][]; default
        [`speculax.InverseCDF`][].
    - `check_values`: whether to run the cheap value checks (draft tokens, uniforms,
        and the probabilities the step reads anyway) as Equinox runtime errors.
        Default `True`.
    - `check_all_probs`: whether to also scan every probability for negative or
        non-finite values, a full pass over both arrays. Default `False`; `True`
        needs `check_values`.
    - `throw`: what a failed value check does. `True` (the default): raise, for the
        whole batch. `False`: give each failed row `num_accepted` 0 and `tokens` all
        `-1`, every other row keeping the answer it has alone, so that one bad
        request does not cost a serving engine its batch; the rows' codes come from
        [`speculax.SpeculativeStep.with_result`][]. Needs `check_values`.

    The pieces that read the vocabulary name the mesh axis it is split over, their
    `axis_name` (see [`speculax.sharded_step`][]); they must agree.

    **Example:**

    ```python
    import jax.numpy as jnp
    import speculax

    step = speculax.SpeculativeStep()
    out = step(
        draft_tokens=jnp.array([[2]]),
        draft_probs=jnp.array([[[0.01, 0.25, 0.49, 0.01, 0.24]]]),
        target_probs=jnp.array(
            [[[0.24, 0.31, 0.06, 0.05, 0.34], [0.04, 0.17, 0.1, 0.14, 0.55]]]
        ),
        accept_uniforms=jnp.array([[0.66]]),
        sample_uniforms=jnp.array([0.38]),
    )
    assert out["num_accepted"].tolist() == [0]
    assert out["tokens"].tolist() == [[0, -1]]
    ```
    """

    acceptance: AbstractAcceptance = RatioAcceptance()
    prefix: AbstractPrefixCount = PrefixCount()
    residual: AbstractResidual = Residual()
    sampler: AbstractSampler = InverseCDF()
    check_values: bool = eqx.field(static=True, default=True, kw_only=True)
    check_all_probs: bool = eqx.field(static=True, default=False, kw_only=True)
    throw: bool = eqx.field(static=True, default=True, kw_only=True)

    def __check_init__(self):
        if not self.check_values and self.check_all_probs:
            raise ValueError("check_all_probs=True needs check_values=True")
        if not self.check_values and not self.throw:
            raise ValueError("throw=False needs check_values=True")
        axes = {
            "acceptance": self.acceptance.axis_name,
            "residual": self.residual.axis_name,
            "sampler": self.sampler.axis_name,
        }
        if len(set(axes.values())) > 1:
            named = ", ".join(f"{piece} {axis!r}" for piece, axis in axes.items())
            raise ValueError(
                f"the pieces must split the vocabulary over the same axis_name; got "
                f"{named}"
            )

    @property
    def axis_name(self) -> str | None:
        """The mesh axis the vocabulary is split over, which the pieces share; `None`
        for whole rows."""
        return self.sampler.axis_name

    def __call__(
        self,
        draft_tokens: InputArray,
        draft_probs: InputArray | None,
        target_probs: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        key: KeyArray | None = None,
        num_draft_tokens: InputArray | None = None,
    ) -> StepOutput:
        """Runs the step on a batch.

        The arguments are JAX or NumPy arrays (or nested lists) of these shapes, with
        $B$ rows, $G$ draft positions and a vocabulary of $V$; their structure is
        checked before any arithmetic, and a mismatch raises `ValueError` (shapes) or
        `TypeError` (dtypes), under `jit` and `vmap` too.

        **Arguments:**

        - `draft_tokens`: integer `(B, G)`, $x_i$, each in `[0, V)`.
        - `draft_probs`: float `(B, G, V)`, $q_i$, the distribution $x_i$ was drawn
            from; or `None` for deterministic drafts (n-gram, EAGLE top-1, Medusa
            heads), meaning $q_i$ is the one-hot of $x_i$: a draft token then passes
            with probability $p_i(x_i)$, and the residual is $p_n$ with $x_n$ taken
            out. No `(B, G, V)` array is made.
        - `target_probs`: float `(B, G + 1, V)`, $p_i$; $p_G$ follows the last draft.
        - `accept_uniforms`: float `(B, G)` in `[0, 1)`, $u_i$. May be omitted when
            `key` is given, or when the acceptance piece is deterministic (its
            `reads_uniforms` is `False`).
        - `sample_uniforms`: float `(B,)` in `[0, 1)`, $s$. May be omitted likewise,
            for a deterministic sampler.
        - `key`: keyword only, a JAX PRNG key (one, or one per row) to draw both
            uniforms from, with [`speculax.uniforms`][], instead of passing them.
        - `num_draft_tokens`: keyword only, integer `(B,)` in `[0, G]`: a ragged
            batch, row $b$ using only its first $g_b$ draft positions. Positions at and
            past $g_b$ are ignored (they may hold anything, e.g. `-1` padding); if all
            $g_b$ drafts pass, the bonus token is drawn from $p_{g_b}$. Row by row the
            same as running that row alone with $G = g_b$.

        **Returns:**

        A [`speculax.StepOutput`][] dict with exactly the keys `num_accepted` (int32
        `(B,)`) and `tokens` (int32 `(B, G + 1)`).

        **Raises:**

        With `check_values=True` and `throw=True` (the defaults), an Equinox runtime
        error (a `RuntimeError`) when a draft token lies outside `[0, V)`, a uniform
        outside `[0, 1)` or is NaN, a probability the step reads is negative or not
        finite, or the distribution drawn from has no positive mass; with
        `check_all_probs=True`, also when any probability anywhere is negative or not
        finite. The message is that of the first failure in the order of
        [`speculax.RESULTS`][]. With `throw=False` nothing is raised at run time: a
        failed row comes back empty, and
        [`speculax.SpeculativeStep.with_result`][] says why.
        """
        output, _ = self.with_result(
            draft_tokens,
            draft_probs,
            target_probs,
            accept_uniforms,
            sample_uniforms,
            key=key,
            num_draft_tokens=num_draft_tokens,
        )
        return output

    def with_result(
        self,
        draft_tokens: InputArray,
        draft_probs: InputArray | None,
        target_probs: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        key: KeyArray | None = None,
        num_draft_tokens: InputArray | None = None,
    ) -> tuple[StepOutput, RESULTS]:
        """Runs the step as [`speculax.SpeculativeStep.__call__`][] does, and returns
        each row's outcome beside the output.

        The codes are a second return value rather than a third key, so that the
        output keeps the problem statement's two keys and its type does not depend on
        a flag.

        **Arguments:**

        As for [`speculax.SpeculativeStep.__call__`][].

        **Returns:**

        A tuple `(output, result)`: the [`speculax.StepOutput`][] dict, and a
        [`speculax.RESULTS`][] item of shape `(B,)`, `successful` or the first value
        check the row failed. Only a step with `throw=False` returns failures (one
        with `throw=True` raises instead), each failed row emptied; every row is
        `successful` for a step with `check_values=False`, which checks nothing.

        **Example:**

        ```python
        import speculax

        step = speculax.SpeculativeStep(throw=False)
        out, result = step.with_result(
            draft_tokens=[[0], [5]],
            draft_probs=[[[0.5, 0.5]], [[0.5, 0.5]]],
            target_probs=[[[0.5, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]]],
            accept_uniforms=[[0.3], [0.3]],
            sample_uniforms=[0.6, 0.6],
        )
        assert sorted(out) == ["num_accepted", "tokens"]
        assert (result == speculax.RESULTS.successful).tolist() == [True, False]
        assert out["tokens"].tolist()[1] == [-1, -1]
        ```
        """
        inputs = coerce_inputs(
            draft_tokens,
            draft_probs,
            target_probs,
            accept_uniforms,
            sample_uniforms,
            num_draft_tokens=num_draft_tokens,
        )
        accept_uniforms, sample_uniforms = inputs.uniforms(
            key, (uniform_reader(self.acceptance), uniform_reader(self.sampler))
        )
        draft_tokens, draft_probs = inputs.tokens, inputs.draft
        target_probs, num_draft_tokens = inputs.target, inputs.num_draft_tokens
        failures = []
        if self.check_values:
            failures += input_failures(
                draft_tokens,
                draft_probs,
                target_probs,
                accept_uniforms,
                sample_uniforms,
                num_draft_tokens,
                reads_draft_probs=self.acceptance.reads_draft_probs,
                scan_all_probs=self.check_all_probs,
                axis_name=self.axis_name,
            )
        passed = self.acceptance(
            draft_tokens,
            draft_probs,
            target_probs,
            accept_uniforms,
            num_draft_tokens=num_draft_tokens,
        )
        if num_draft_tokens is not None:
            in_use = jnp.arange(passed.shape[1])[None, :] < num_draft_tokens[:, None]
            passed = passed & in_use
        num_accepted = self.prefix(passed)
        drawn, row_failures = draw_token(
            self.residual,
            self.sampler,
            num_accepted,
            draft_tokens,
            draft_probs,
            target_probs,
            sample_uniforms,
            num_draft_tokens=num_draft_tokens,
            check_values=self.check_values,
        )
        if self.check_values:
            vocab = full_vocab(target_probs.shape[-1], self.axis_name)
            failures += [*row_failures, sampled_failure(drawn, vocab)]
        result = first_failure(failures, draft_tokens.shape[0])
        output: StepOutput = {
            "num_accepted": num_accepted.astype(jnp.int32),
            "tokens": assemble_tokens(draft_tokens, num_accepted, drawn),
        }
        return report_failures(
            output, result, check_values=self.check_values, throw=self.throw
        )


def assemble_tokens(
    draft_tokens: Int[Array, "batch draft"],
    num_accepted: Int[Array, " batch"],
    drawn: Int[Array, " batch"],
) -> Int[Array, "batch draft+1"]:
    batch, num_draft = draft_tokens.shape
    position = jnp.arange(num_draft + 1)[None, :]
    stop = num_accepted[:, None]
    padded = jnp.concatenate(
        [draft_tokens.astype(jnp.int32), jnp.full((batch, 1), -1, jnp.int32)], axis=1
    )
    return jnp.where(
        position < stop,
        padded,
        jnp.where(position == stop, drawn[:, None].astype(jnp.int32), -1),
    )


_default_step = eqx.filter_jit(SpeculativeStep())


def speculative_step(
    draft_tokens: InputArray,
    draft_probs: InputArray | None,
    target_probs: InputArray,
    accept_uniforms: InputArray | None = None,
    sample_uniforms: InputArray | None = None,
    *,
    key: KeyArray | None = None,
    num_draft_tokens: InputArray | None = None,
) -> StepOutput:
    """The verification step with the default pieces, compiled once per input
    structure and cached.

    Equivalent to `eqx.filter_jit(SpeculativeStep())(...)`; see
    [`speculax.SpeculativeStep.__call__`][] for the arguments, the shapes and the
    errors.

    **Arguments:**

    - `draft_tokens`: integer `(B, G)`.
    - `draft_probs`: float `(B, G, V)`.
    - `target_probs`: float `(B, G + 1, V)`.
    - `accept_uniforms`: float `(B, G)` in `[0, 1)`.
    - `sample_uniforms`: float `(B,)` in `[0, 1)`.
    - `key`: keyword only, a PRNG key to draw both uniforms from instead.
    - `num_draft_tokens`: keyword only, integer `(B,)`: each row's draft length, for
        a ragged batch.

    Each may be a JAX array, a NumPy array or a nested Python list.

    **Returns:**

    A [`speculax.StepOutput`][] dict: `num_accepted` int32 `(B,)` and `tokens` int32
    `(B, G + 1)`.

    **Example:**

    ```python
    import speculax

    out = speculax.speculative_step(
        draft_tokens=[[3, 2]],
        draft_probs=[[[0.2, 0.59, 0.04, 0.17], [0.12, 0.43, 0.42, 0.03]]],
        target_probs=[
            [
                [0.04, 0.44, 0.24, 0.28],
                [0.27, 0.36, 0.23, 0.14],
                [0.19, 0.34, 0.07, 0.4],
            ]
        ],
        accept_uniforms=[[0.27, 0.79]],
        sample_uniforms=[0.92],
    )
    assert out["tokens"].tolist() == [[3, 3, -1]]
    ```
    """
    # Lists must become arrays before jit, which would otherwise see each number as a
    # separate scalar argument.
    return _default_step(
        index_array(draft_tokens),
        optional_array(draft_probs),
        jnp.asarray(target_probs),
        optional_array(accept_uniforms),
        optional_array(sample_uniforms),
        key=key,
        num_draft_tokens=optional_index_array(num_draft_tokens),
    )


def greedy_step(
    *, check_values: bool = True, check_all_probs: bool = False, throw: bool = True
) -> SpeculativeStep:
    """The step of greedy verification: a draft token passes when it is the target's
    most likely token, and the correction or bonus token is the target's most likely
    token at the stopping position. No uniforms are read. Since only which token of
    a row is most likely is read, logits give the tokens of their probabilities
    where `check_values=False` (the value checks read probabilities, and refuse
    logits by name).

    **Arguments:**

    - `check_values`, `check_all_probs`, `throw`: keyword only, as for
        [`speculax.SpeculativeStep`][].

    **Returns:**

    `SpeculativeStep(GreedyAcceptance(), PrefixCount(), TargetRow(), Argmax())`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import speculax

    step = speculax.greedy_step()
    out = step(
        draft_tokens=jnp.array([[1, 2]]),
        draft_probs=jnp.zeros((1, 2, 3)),
        target_probs=jnp.array([[[0.2, 0.5, 0.3], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8]]]),
    )
    # Token 1 is p_0's argmax and passes; token 2 is not p_1's (0 is): y = 0.
    assert out["tokens"].tolist() == [[1, 0, -1]]
    ```
    """
    return SpeculativeStep(
        GreedyAcceptance(),
        PrefixCount(),
        TargetRow(),
        Argmax(),
        check_values=check_values,
        check_all_probs=check_all_probs,
        throw=throw,
    )


def block_step(
    *,
    check_values: bool = True,
    check_all_probs: bool | None = None,
    throw: bool = True,
) -> SpeculativeStep:
    """The step of block verification (Sun et al., 2025): the drafts are judged as a
    block, a pass at a later position keeping the drafts before it even where their
    own tests failed. Lossless like the token-by-token step, and never keeps fewer
    tokens in expectation: usually more when the drafts are sampled, exactly as many
    when they are deterministic (`draft_probs=None`), where it only costs more. See
    `docs/keeping_more.md` for the statement, the gain and the cost.

    **Arguments:**

    - `check_values`, `throw`: keyword only, as for [`speculax.SpeculativeStep`][].
    - `check_all_probs`: keyword only, as for [`speculax.SpeculativeStep`][]; the
        default `None` means `check_values`, since the test reads every row and a
        bad value anywhere in them would otherwise change the verdicts unseen.

    **Returns:**

    `SpeculativeStep(BlockAcceptance(), LastPassCount(), BlockResidual(),
    InverseCDF())`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import speculax

    step = speculax.block_step()
    out = step(
        draft_tokens=jnp.array([[0, 1]]),
        draft_probs=jnp.array([[[0.8, 0.2], [0.5, 0.5]]]),
        target_probs=jnp.array([[[0.4, 0.6], [0.1, 0.9], [0.5, 0.5]]]),
        accept_uniforms=jnp.array([[0.9, 0.7]]),
        sample_uniforms=jnp.array([0.3]),
    )
    # Token 0 fails its own test (0.9 >= 0.4 / 0.8), but the block passes at
    # position 1 (0.7 < P_2 = min(1, 0.5 * 0.9 / 0.5) = 0.9): both drafts are kept.
    assert out["tokens"].tolist() == [[0, 1, 0]]
    ```
    """
    return SpeculativeStep(
        BlockAcceptance(),
        LastPassCount(),
        BlockResidual(),
        InverseCDF(),
        check_values=check_values,
        check_all_probs=check_values if check_all_probs is None else check_all_probs,
        throw=throw,
    )
