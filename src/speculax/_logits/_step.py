import functools
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._chain._step import StepOutput, assemble_tokens
from .._core._failures import (
    RESULTS,
    Failure,
    draft_failures,
    first_failure,
    positions_in_use,
    report_failures,
    sampled_failure,
    stopping_row_failures,
)
from .._core._numerics import arithmetic_dtype, flush_subnormal
from .._core._row_strategy import rows_one_at_a_time
from .._core._rows import read_row
from .._core._vocab_axis import entries_at, full_vocab, vocab_offset
from .._inputs._coercion import StepInputs, coerce_inputs
from .._inputs._input_array import InputArray
from .._inputs._random import KeyArray
from .._pieces._prefix import PrefixCount
from .._pieces._sampling import InverseCDF, sample_residual
from .._pieces._stopping_rows import stopping_row_summary
from ._parameters import SamplingParameters, sampling_parameters
from ._truncation import (
    RowStatistics,
    probability,
    request_statistics,
)


@final
class LogitsStep(eqx.Module):
    """The verification step from logits, as serving engines call it: one set of
    sampling parameters per request, greedy and sampled requests in one batch, and no
    probability array made.

    Row $b$ verifies against the distributions its logits define under its own
    temperature $T_b$, top-$k$ and top-$p$ (in that order, then renormalised: the
    definition of [`speculax.probs_from_logits`][], and `docs/from_logits.md`):

    - $T_b > 0$: rejection sampling, the rule of [`speculax.SpeculativeStep`][].
        Draft token $x_i$ passes when $u_i \\, q_i(x_i) < p_i(x_i)$, and the
        correction or bonus token is drawn by inverse CDF from
        $\\max(p_n - q_n, 0)$ or $p_G$, where $p_i$ and $q_i$ are the target's and
        the draft's logits under row $b$'s parameters. **The drafts must have been
        sampled from exactly these $q_i$**: the draft logits under the same
        temperature, top-$k$ and top-$p$.
    - $T_b = 0$: greedy verification, the rule of [`speculax.greedy_step`][]: a
        draft passes when it is the first argmax of the target's logits, and the
        token drawn is the argmax at the stopping position. The draft logits are not
        read.

    Row by row the answer is that of [`speculax.probs_from_logits`][] followed by the
    step, and never depends on the other rows' parameters. The row statistics (the
    largest logit, the thresholds, the normaliser) take one pass over each row of
    logits; only the two rows drawn from are turned into probabilities, `(B, V)`
    each.

    **Arguments:**

    - `check_values`: keyword only, whether to run the value checks (the ragged
        lengths, the tokens, the uniforms, the parameters, and NaN, $+\\infty$ or
        rows all $-\\infty$ in the logits the step reads) as Equinox runtime errors.
        Default `True`.
    - `throw`: keyword only, as for [`speculax.SpeculativeStep`][]: `False` empties
        a failed row instead of raising, and [`speculax.LogitsStep.with_result`][]
        returns one [`speculax.RESULTS`][] item per row. Default `True`; `False`
        needs `check_values`.
    - `axis_name`: keyword only, inside `jax.shard_map`, the mesh axis the
        vocabulary is split over: the logits are then each device's slices of the
        rows, every statistic is that of the whole rows, and the answer is the
        answer on one device, bit for bit, when the slices are whole blocks of 256
        tokens. [`speculax.sharded_step`][] sets it. Default `None`, whole rows.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import speculax

    # Under jit, compiled once per shape (eagerly, each operation is dispatched alone:
    # seconds for this batch, three times as long).
    step = jax.jit(speculax.LogitsStep())
    target_logits = jax.random.normal(jax.random.key(0), (3, 3, 50))
    draft_logits = jax.random.normal(jax.random.key(1), (3, 2, 50))
    out = step(
        jnp.array([[4, 7], [1, 2], [9, 9]]),
        draft_logits,
        target_logits,
        temperature=jnp.array([0.0, 0.7, 1.0]),  # row 0 is greedy
        top_k=jnp.array([0, 20, 0]),
        top_p=jnp.array([1.0, 1.0, 0.9]),
        key=jax.random.key(2),
    )
    assert out["tokens"].shape == (3, 3)
    ```
    """

    check_values: bool = eqx.field(static=True, default=True, kw_only=True)
    throw: bool = eqx.field(static=True, default=True, kw_only=True)
    axis_name: str | None = eqx.field(static=True, default=None, kw_only=True)

    def __check_init__(self):
        if not self.check_values and not self.throw:
            raise ValueError("throw=False needs check_values=True")

    def __call__(
        self,
        draft_tokens: InputArray,
        draft_logits: InputArray | None,
        target_logits: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        temperature: ArrayLike = 1.0,
        top_k: ArrayLike | None = None,
        top_p: ArrayLike | None = None,
        key: KeyArray | None = None,
        num_draft_tokens: InputArray | None = None,
    ) -> StepOutput:
        """Runs the step on a batch of $B$ rows, $G$ draft positions and a
        vocabulary of $V$; structure is checked before any arithmetic, as for
        [`speculax.SpeculativeStep.__call__`][].

        **Arguments:**

        - `draft_tokens`: integer `(B, G)`, $x_i$, each in `[0, V)`.
        - `draft_logits`: float `(B, G, V)`, the draft model's logits at each
            draft position, any float dtype; or `None` for deterministic drafts
            ($q_i$ the one-hot of $x_i$).
        - `target_logits`: float `(B, G + 1, V)`, the target model's logits, the
            last position following the last draft.
        - `accept_uniforms`, `sample_uniforms`: float `(B, G)` and `(B,)` in
            `[0, 1)`; may be omitted when `key` is given, or when `temperature` is
            the Python number `0` (greedy verification reads none).
        - `temperature`, `top_k`, `top_p`: keyword only, each a Python number, a
            scalar or an array of shape `(B,)`, one value per row, which may be
            traced: one compilation serves every mix. `temperature` finite and
            $\\ge 0$, `0` meaning greedy (default `1`); `top_k` $\\ge 0$ in any
            integer dtype, `0` or at least $V$ keeping all (`None`, the default, is
            `0`); `top_p` in `(0, 1]`, `1` keeping all (`None`, the default, is
            `1`). Python numbers are read before tracing, so that the program
            leaves out what no row needs: `temperature=0` compiles greedy
            verification alone, and `top_k` and `top_p` each `None` or keeping all
            compile no truncation. The answers are those of the same values given
            as arrays, bit for bit.
        - `key`: keyword only, a PRNG key (one, or one per row) to draw the uniforms
            from with [`speculax.uniforms`][].
        - `num_draft_tokens`: keyword only, integer `(B,)` in `[0, G]`, for a ragged
            batch: the logits at and past a row's length are not read (they may hold
            anything).

        **Returns:**

        A [`speculax.StepOutput`][] dict with exactly the keys `num_accepted` (int32
        `(B,)`) and `tokens` (int32 `(B, G + 1)`).

        **Raises:**

        `ValueError` or `TypeError` for a structure that does not fit, or a Python
        number out of range among the parameters; with `check_values=True` and
        `throw=True`, an Equinox runtime error (a `RuntimeError`) naming the first
        failing check in the order of `docs/specification.md`'s table.
        """
        output, _ = self.with_result(
            draft_tokens,
            draft_logits,
            target_logits,
            accept_uniforms,
            sample_uniforms,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            key=key,
            num_draft_tokens=num_draft_tokens,
        )
        return output

    def with_result(
        self,
        draft_tokens: InputArray,
        draft_logits: InputArray | None,
        target_logits: InputArray,
        accept_uniforms: InputArray | None = None,
        sample_uniforms: InputArray | None = None,
        *,
        temperature: ArrayLike = 1.0,
        top_k: ArrayLike | None = None,
        top_p: ArrayLike | None = None,
        key: KeyArray | None = None,
        num_draft_tokens: InputArray | None = None,
    ) -> tuple[StepOutput, RESULTS]:
        """Runs the step as [`speculax.LogitsStep.__call__`][] does, and returns each
        row's outcome beside the output, as
        [`speculax.SpeculativeStep.with_result`][] does.

        **Arguments:**

        As for [`speculax.LogitsStep.__call__`][].

        **Returns:**

        A tuple `(output, result)`: the [`speculax.StepOutput`][] dict, and a
        [`speculax.RESULTS`][] item of shape `(B,)` per row.
        """
        inputs, parameters, accept_uniforms, sample_uniforms = read_logits_inputs(
            draft_tokens,
            draft_logits,
            target_logits,
            accept_uniforms,
            sample_uniforms,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            key=key,
            num_draft_tokens=num_draft_tokens,
        )
        batch, num_draft = inputs.tokens.shape
        if batch == 0:
            empty: StepOutput = {
                "num_accepted": jnp.zeros((0,), jnp.int32),
                "tokens": jnp.zeros((0, num_draft + 1), jnp.int32),
            }
            return empty, first_failure([], 0)
        num_accepted, drawn, read_failures = _verify(
            inputs,
            accept_uniforms,
            sample_uniforms,
            parameters,
            check_values=self.check_values,
            axis_name=self.axis_name,
        )
        failures: list[Failure] = []
        if self.check_values:
            failures = _value_failures(
                inputs,
                accept_uniforms,
                sample_uniforms,
                parameters,
                read_failures,
                drawn,
                full_vocab(inputs.target.shape[-1], self.axis_name),
            )
        result = first_failure(failures, batch)
        output: StepOutput = {
            "num_accepted": num_accepted.astype(jnp.int32),
            "tokens": assemble_tokens(inputs.tokens, num_accepted, drawn),
        }
        return report_failures(
            output, result, check_values=self.check_values, throw=self.throw
        )


def read_logits_inputs(
    draft_tokens: InputArray,
    draft_logits: InputArray | None,
    target_logits: InputArray,
    accept_uniforms: InputArray | None,
    sample_uniforms: InputArray | None,
    *,
    temperature: ArrayLike,
    top_k: ArrayLike | None,
    top_p: ArrayLike | None,
    key: KeyArray | None,
    num_draft_tokens: InputArray | None,
) -> tuple[
    StepInputs, SamplingParameters, Float[Array, "batch draft"], Float[Array, " batch"]
]:
    """The arguments of [`speculax.LogitsStep.__call__`][] read as the step reads
    them: the inputs coerced and their structure checked, the sampling parameters
    one value per row (their errors before the uniforms'), and the uniforms as
    given or drawn from `key`, for the whole batch."""
    inputs = coerce_inputs(
        draft_tokens,
        draft_logits,
        target_logits,
        accept_uniforms,
        sample_uniforms,
        num_draft_tokens=num_draft_tokens,
        given_as="logits",
    )
    parameters = sampling_parameters(
        temperature,
        top_k,
        top_p,
        inputs.tokens.shape[0],
        arithmetic_dtype(inputs.target, inputs.draft),
    )
    # Greedy verification reads no uniforms: zeros stand for those not given.
    reader = None if parameters.all_greedy else "LogitsStep"
    accept, sample = inputs.uniforms(key, (reader, reader))
    return inputs, parameters, accept, sample


def _verify(
    inputs: StepInputs,
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    parameters: SamplingParameters,
    *,
    check_values: bool,
    axis_name: str | None,
) -> tuple[Int[Array, " batch"], Int[Array, " batch"], list[Failure]]:
    """The verification of a non-empty batch: the statistics of every row of
    logits, each draft's test, the number $n$ of drafts accepted and the token drawn
    at $n$, each `(batch,)`; with `check_values`, the failures of the logits the step
    read (`_logits_failures`, then the stopping rows'), else none. `axis_name` as
    for the step."""
    draft_tokens, draft_logits = inputs.tokens, inputs.draft
    target_logits, num_draft_tokens = inputs.target, inputs.num_draft_tokens
    num_draft = draft_tokens.shape[1]
    length = (
        jnp.full((draft_tokens.shape[0],), num_draft, jnp.int32)
        if num_draft_tokens is None
        else jnp.clip(num_draft_tokens, 0, num_draft)
    )
    in_use = positions_in_use(draft_tokens.shape, num_draft_tokens)
    draft = None
    if draft_logits is None or parameters.all_greedy:
        (target,) = request_statistics((target_logits,), parameters, axis_name)
    else:
        target, draft = request_statistics(
            (target_logits, draft_logits), parameters, axis_name
        )
    passed = _verdicts(
        draft_tokens,
        draft_logits,
        target_logits,
        accept_uniforms,
        parameters,
        target,
        draft,
        axis_name,
    )
    num_accepted = PrefixCount()(passed & in_use)
    drawn, row_failures = _draw(
        num_accepted,
        length,
        draft_tokens,
        draft_logits,
        target_logits,
        sample_uniforms,
        parameters,
        target,
        draft,
        axis_name,
    )
    failures: list[Failure] = []
    if check_values:
        failures = [
            *_logits_failures(length, num_accepted, parameters, target, draft),
            *row_failures,
        ]
    return num_accepted, drawn, failures


def _value_failures(
    inputs: StepInputs,
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    parameters: SamplingParameters,
    read_failures: list[Failure],
    drawn: Int[Array, " batch"],
    vocab: int,
) -> list[Failure]:
    """Every value check, in the order of [`speculax.RESULTS`][]: the tokens, the
    uniforms and the lengths, the parameters, the logits read (`read_failures`,
    from `_verify`), and the token drawn (in `[0, vocab)`)."""
    return [
        *draft_failures(
            inputs.tokens,
            accept_uniforms,
            sample_uniforms,
            inputs.num_draft_tokens,
            vocab,
        ),
        *parameters.failures(),
        *read_failures,
        sampled_failure(drawn, vocab),
    ]


def _verdicts(
    draft_tokens: Int[Array, "batch draft"],
    draft_logits: Float[Array, "batch draft vocab"] | None,
    target_logits: Float[Array, "batch draft+1 vocab"],
    accept_uniforms: Float[Array, "batch draft"],
    parameters: SamplingParameters,
    target: RowStatistics,
    draft: RowStatistics | None,
    axis_name: str | None,
) -> Bool[Array, "batch draft"]:
    """Each draft's test: $u_i \\, q_i(x_i) < p_i(x_i)$ for sampled rows (the
    probabilities below the smallest normal number counting as zero, as for
    probabilities given), $x_i = \\arg\\max$ for greedy ones."""
    batch, num_draft = draft_tokens.shape
    if num_draft == 0:
        return jnp.zeros((batch, 0), bool)
    greedy = draft_tokens == target.argmax[:, :num_draft]
    if parameters.all_greedy:
        return greedy
    vocab = full_vocab(target_logits.shape[-1], axis_name)
    tokens = jnp.clip(draft_tokens, 0, vocab - 1)
    temperature = parameters.temperature[:, None]
    positions = jnp.arange(num_draft)[None, :]

    def at_tokens(logits, statistics):
        # A point gather, not a slice of the logits: XLA CPU would copy the slice.
        logit = entries_at(logits, positions, tokens, axis_name=axis_name)
        statistics = jax.tree.map(lambda x: x[:, :num_draft], statistics)
        return flush_subnormal(probability(logit, tokens, statistics, temperature))

    target_probability = at_tokens(target_logits, target)
    draft_probability = (
        jnp.ones_like(target_probability)
        if draft_logits is None or draft is None
        else at_tokens(draft_logits, draft)
    )
    sampled = accept_uniforms * draft_probability < target_probability
    return jnp.where(parameters.greedy[:, None], greedy, sampled)


def _draw(
    num_accepted: Int[Array, " batch"],
    length: Int[Array, " batch"],
    draft_tokens: Int[Array, "batch draft"],
    draft_logits: Float[Array, "batch draft vocab"] | None,
    target_logits: Float[Array, "batch draft+1 vocab"],
    sample_uniforms: Float[Array, " batch"],
    parameters: SamplingParameters,
    target: RowStatistics,
    draft: RowStatistics | None,
    axis_name: str | None,
) -> tuple[Int[Array, " batch"], list[Failure]]:
    """The token at each row's stopping position $n$: the argmax of the target's
    logits for greedy rows; for sampled rows, drawn from $\\max(p_n - q_n, 0)$ (or
    $p_n$ when $n$ is the row's length) by the fused residual and inverse CDF of the
    probability step, on the rows $p_n$ and $q_n$ made from the logits, so that the
    same rows give the same token, bit for bit."""
    batch, num_draft = draft_tokens.shape
    rows = jnp.arange(batch)
    greedy = target.argmax[rows, num_accepted]
    if parameters.all_greedy:
        return greedy, []
    # The draft row at n < length; at n = length it is not subtracted.
    subtracting = num_accepted < length
    draft_position = jnp.minimum(num_accepted, max(num_draft - 1, 0))
    target_row = _probability_rows(
        target_logits, num_accepted, target, parameters.temperature, axis_name
    )
    draft_row = None
    if draft_logits is not None and draft is not None and num_draft > 0:
        draft_row = _probability_rows(
            draft_logits, draft_position, draft, parameters.temperature, axis_name
        )[:, None]
    rejected = None
    if num_draft > 0:
        rejected = jnp.take_along_axis(draft_tokens, draft_position[:, None], axis=1)
    sampler = InverseCDF(axis_name=axis_name)
    summary = stopping_row_summary(
        jnp.zeros((batch,), jnp.int32),
        draft_row,
        target_row[:, None],
        block_size=sampler.block_size,
        num_draft_tokens=subtracting.astype(jnp.int32),
        draft_tokens=rejected,
        axis_name=axis_name,
    )
    sampled = sample_residual(summary, sampler, sample_uniforms)
    drawn = jnp.where(parameters.greedy, greedy, sampled)
    failures = [
        (where & ~parameters.greedy, failure)
        for where, failure in stopping_row_failures(summary.row_mass)
    ]
    return drawn, failures


# Compiled on its own for the reason `request_statistics` is.
@functools.partial(jax.jit, static_argnames="axis_name")
def _probability_rows(
    logits: Float[Array, "batch positions vocab"],
    position: Int[Array, " batch"],
    statistics: RowStatistics,
    temperature: Float[Array, " batch"],
    axis_name: str | None,
) -> Float[Array, "batch vocab"]:
    """The distribution of each row's logits at `position`, one `(batch, vocab)`
    array and nothing else that size (this device's slices of the rows, on a split
    vocabulary)."""
    batch, _, vocab = logits.shape
    tokens = jnp.arange(vocab) + vocab_offset(vocab, axis_name)
    rows = jnp.arange(batch)
    at_position = jax.tree.map(lambda x: x[rows, position], statistics)
    if not rows_one_at_a_time():
        return probability(
            logits[rows, position],
            tokens[None, :],
            jax.tree.map(lambda x: x[:, None], at_position),
            temperature[:, None],
        )

    def one_row(b):
        row_statistics = jax.tree.map(lambda x: x[b], at_position)
        row = read_row(logits, b, position[b]).astype(arithmetic_dtype(logits))
        return probability(row, tokens, row_statistics, temperature[b])

    return jax.lax.map(one_row, rows)


def _logits_failures(
    length: Int[Array, " batch"],
    num_accepted: Int[Array, " batch"],
    parameters: SamplingParameters,
    target: RowStatistics,
    draft: RowStatistics | None,
) -> list[Failure]:
    """NaN, $+\\infty$ or no finite value in the rows the step reads, as the
    probability step reads its rows: NaN or $+\\infty$ in the target's positions
    below each row's length (each draft's test reads $p_i(x_i)$, which a bad value
    anywhere in the row spoils) and at the stopping position $n$; no finite value at
    the positions up to $n$ (the rows the drafts passed in, and the one drawn from).
    The row at the row's length, $p_{g_b}$, is read only when $n = g_b$, and a row
    past $n$ without a finite value gives its draft probability 0, as an all-zero
    row of probabilities does. The draft's positions below the length are read
    (sampled rows only)."""
    positions = jnp.arange(target.maximum.shape[1])[None, :]
    stop = num_accepted[:, None]
    target_read = (positions < length[:, None]) | (positions == stop)
    bad = [(jnp.any(target.bad & target_read, axis=1), RESULTS.bad_target_logits)]
    empty = [
        (
            jnp.any(target.empty & (positions <= stop), axis=1),
            RESULTS.no_finite_target_logit,
        )
    ]
    if draft is not None:
        draft_read = (positions[:, :-1] < length[:, None]) & (
            ~parameters.greedy[:, None]
        )
        bad.append((jnp.any(draft.bad & draft_read, axis=1), RESULTS.bad_draft_logits))
        empty.append(
            (jnp.any(draft.empty & draft_read, axis=1), RESULTS.no_finite_draft_logit)
        )
    return bad + empty
