"""The run-time failures of a step (`docs/specification.md`, "Bad input"): one
enumeration, the value checks that produce it row by row, and the two ways of
reporting it (raise, or return the codes)."""

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree

from ._vocab_axis import any_over_vocab, full_vocab, probs_at_tokens


class RESULTS(eqx.Enumeration):
    """The outcome of a step for each row: `successful`, or the first value check
    the row fails.

    The checks run in the order of `docs/specification.md`'s bad-input table, so
    that a cause comes before its consequences (a NaN in $p_n$ before the empty
    residual it leads to); the failures are listed here in the **reverse** of that
    order, so that of two failures the first in the table has the larger index: the
    rule by which Equinox reports one error for a whole (or vmapped) batch.

    A step with `throw=True` (the default) raises the message of the first failure
    over all rows; with `throw=False` its `with_result` returns one item per row
    beside the output (see [`speculax.SpeculativeStep.with_result`][]). Compare
    items with `==` (`result == speculax.RESULTS.successful` is a boolean array, one
    entry per row), and read the rows' messages with [`speculax.failure_messages`][].
    """

    successful = ""
    no_mass = (
        "no token can be drawn: the residual at the stopping position n has no "
        "positive mass, even after falling back to target_probs[b, n], which has no "
        "positive entry (values below the smallest normal number count as zero)"
    )
    target_row_overflows = (
        "target_probs must have rows whose total the arithmetic dtype can hold; the "
        "row p_n at the stopping position n = num_accepted sums past the largest "
        "finite number (normalise it)"
    )
    bad_draft_row = (
        "draft_probs must be finite and non-negative; got a negative, NaN or "
        "infinite value in the row q_n at the stopping position n = num_accepted"
    )
    bad_target_row = (
        "target_probs must be finite and non-negative; got a negative, NaN or "
        "infinite value in the row p_n at the stopping position n = num_accepted"
    )
    bad_draft_prob_at_draft_token = (
        "draft_probs must be finite and non-negative; got a negative, NaN or "
        "infinite q_i(x_i) at a draft token"
    )
    bad_target_prob_at_draft_token = (
        "target_probs must be finite and non-negative; got a negative, NaN or "
        "infinite p_i(x_i) at a draft token"
    )
    bad_draft_probs = (
        "draft_probs must be finite and non-negative; got a negative, NaN or infinite "
        "value (check_all_probs)"
    )
    bad_target_probs = (
        "target_probs must be finite and non-negative; got a negative, NaN or infinite "
        "value (check_all_probs)"
    )
    no_finite_draft_logit = (
        "draft_logits must hold a finite value in every row the step reads; got a "
        "row that is all -inf"
    )
    no_finite_target_logit = (
        "target_logits must hold a finite value in every row the step reads; got a "
        "row that is all -inf"
    )
    bad_draft_logits = (
        "draft_logits must be finite or -inf; got NaN or +inf in a row the step reads"
    )
    bad_target_logits = (
        "target_logits must be finite or -inf; got NaN or +inf in a row the step reads"
    )
    top_p_out_of_range = "top_p must lie in (0, 1]; got a value outside it or NaN"
    top_k_out_of_range = "top_k must be non-negative (0 keeps all); got a negative one"
    temperature_out_of_range = (
        "temperature must be finite and non-negative (0 means greedy); got a negative "
        "one, inf or NaN"
    )
    sample_uniform_out_of_range = (
        "sample_uniforms must lie in [0, 1); got a value outside it or NaN"
    )
    accept_uniform_out_of_range = (
        "accept_uniforms must lie in [0, 1); got a value outside it or NaN"
    )
    draft_token_out_of_range = "draft_tokens must lie in [0, V); got a token outside it"
    num_draft_tokens_out_of_range = (
        "num_draft_tokens must lie in [0, G]; got a length outside it"
    )
    tree_token_out_of_range = "tree_tokens must lie in [0, V); got a token outside it"
    bad_parents = (
        "parents must give each draft node j a parent in [0, j) that is itself in "
        "use, or -1 for an unused slot; got one that does not"
    )


# The rows where a value check fails, and the failure it reports.
Failure: TypeAlias = tuple[Bool[Array, " batch"], RESULTS]


def _rows(where: Bool[Array, "batch *rest"]) -> Bool[Array, " batch"]:
    return jnp.any(where, axis=tuple(range(1, where.ndim)))


def input_failures(
    draft_tokens: Int[Array, "batch draft"],
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch draft+1 vocab"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    num_draft_tokens: Int[Array, " batch"] | None,
    *,
    reads_draft_probs: bool,
    scan_all_probs: bool,
    axis_name: str | None,
) -> list[Failure]:
    """The checks of the ragged lengths, the tokens, the uniforms and the draft
    tokens' probabilities (which the step reads anyway), at the draft positions in use
    (below `num_draft_tokens`), in the order they are reported; $q_i(x_i)$ only if
    some piece `reads_draft_probs`; with `scan_all_probs`, the full scan of both
    arrays too, at the positions in use. `axis_name` names the mesh axis the
    vocabulary is split over, inside `shard_map`.
    """
    vocab = full_vocab(target_probs.shape[-1], axis_name)
    in_use = positions_in_use(draft_tokens.shape, num_draft_tokens)
    target_at_draft, draft_at_draft = probs_at_tokens(
        draft_tokens,
        draft_probs if reads_draft_probs else None,
        target_probs,
        axis_name=axis_name,
    )
    return [
        *draft_failures(
            draft_tokens, accept_uniforms, sample_uniforms, num_draft_tokens, vocab
        ),
        *(
            _all_probs_failures(draft_probs, target_probs, in_use, axis_name)
            if scan_all_probs
            else []
        ),
        (
            _rows(in_use & not_a_probability(target_at_draft)),
            RESULTS.bad_target_prob_at_draft_token,
        ),
        (
            _rows(in_use & not_a_probability(draft_at_draft)),
            RESULTS.bad_draft_prob_at_draft_token,
        ),
    ]


def draft_failures(
    draft_tokens: Int[Array, "batch draft"],
    accept_uniforms: Float[Array, "batch draft"],
    sample_uniforms: Float[Array, " batch"],
    num_draft_tokens: Int[Array, " batch"] | None,
    vocab: int,
) -> list[Failure]:
    """The checks every chain step makes first, whatever its distributions are given
    as: the ragged lengths, then the draft tokens and the accept uniforms at the
    positions in use, then the sample uniforms."""
    num_draft = draft_tokens.shape[1]
    failures = []
    if num_draft_tokens is not None:
        failures.append(
            (
                (num_draft_tokens < 0) | (num_draft_tokens > num_draft),
                RESULTS.num_draft_tokens_out_of_range,
            )
        )
    in_use = positions_in_use(draft_tokens.shape, num_draft_tokens)
    return [
        *failures,
        (
            _rows(in_use & ((draft_tokens < 0) | (draft_tokens >= vocab))),
            RESULTS.draft_token_out_of_range,
        ),
        (
            _rows(in_use & outside_unit_interval(accept_uniforms)),
            RESULTS.accept_uniform_out_of_range,
        ),
        (outside_unit_interval(sample_uniforms), RESULTS.sample_uniform_out_of_range),
    ]


def positions_in_use(
    shape: tuple[int, ...], num_draft_tokens: Int[Array, " batch"] | None
) -> Bool[Array, "batch draft"]:
    """Which draft positions each row uses, for draft tokens of shape `shape`,
    `(batch, draft)`: those below its `num_draft_tokens`, or all."""
    batch, num_draft = shape
    if num_draft_tokens is None:
        return jnp.ones((batch, num_draft), bool)
    return jnp.arange(num_draft)[None, :] < num_draft_tokens[:, None]


def _all_probs_failures(
    draft_probs: Float[Array, "batch draft vocab"] | None,
    target_probs: Float[Array, "batch positions vocab"],
    in_use: Bool[Array, "batch draft"],
    axis_name: str | None,
) -> list[Failure]:
    """The full scan of every probability for negative or non-finite values, at the
    positions in use ($p_{g_b}$ included): a pass over both arrays, so opt-in
    (`check_all_probs`).

    The pass is one flat reduction per array, which XLA CPU runs several times
    faster than per-row reductions, and it only asks whether any value anywhere is
    bad; the rows that hold one are found by a second pass, run only then (also
    when the bad value lies in padding past $g_b$, which the second pass ignores).
    """
    arrays = [target_probs] + ([] if draft_probs is None else [draft_probs])
    suspect = jnp.any(jnp.stack([holds_bad_values(x, axis=None) for x in arrays]))
    # The same branch on every device: the second pass reduces over the mesh axis.
    suspect = any_over_vocab(suspect, axis_name)
    # Position i of p is in use when i = 0 or position i - 1 of the drafts is.
    target_in_use = jnp.concatenate([jnp.ones_like(in_use[:, :1]), in_use], axis=1)

    def bad_rows() -> Bool[Array, "arrays batch"]:
        flags = [target_in_use] + ([] if draft_probs is None else [in_use])
        return jnp.stack(
            [
                any_over_vocab(_rows(used & holds_bad_values(x, axis=-1)), axis_name)
                for x, used in zip(arrays, flags, strict=True)
            ]
        )

    none = jnp.zeros((len(arrays), in_use.shape[0]), bool)
    bad = jax.lax.cond(suspect, bad_rows, lambda: none)
    failures = [(bad[0], RESULTS.bad_target_probs)]
    if draft_probs is not None:
        failures.append((bad[1], RESULTS.bad_draft_probs))
    return failures


def holds_bad_values(x: Float[Array, "..."], axis: int | None) -> Bool[Array, "..."]:
    """Whether `x` holds a negative or non-finite value along `axis` (`None`: all of
    it), by a sum that is exactly 0 for valid values: $\\min(x, 0)$ is negative for a
    negative $x$, and $0 \\cdot x$ is NaN for an infinite or NaN one. One reduction
    fused with its elementwise work, where a boolean `any` makes XLA CPU
    materialise the flags; a minimum would read faster, but XLA CPU's drops NaN."""
    return jnp.sum(jnp.minimum(x, 0) + 0 * x, axis=axis) != 0


def stopping_row_failures(row_mass: Float[Array, " batch"]) -> list[Failure]:
    """The checks of the rows $p_n$ and $q_n$ that the step draws from, read from the
    flags that their one-pass summary carries into each row's total mass
    (`RowSummary.row_mass`: NaN for a bad value in $p_n$, $-\\infty$ for one in
    $q_n$): nearly free when the summary serves the sampling too.
    """
    return [
        (jnp.isnan(row_mass), RESULTS.bad_target_row),
        (row_mass == -jnp.inf, RESULTS.bad_draft_row),
    ]


def overflow_failure(row_mass: Float[Array, " batch"]) -> Failure:
    """The check that the weights drawn from have a total the arithmetic dtype can
    hold, for samplers that normalise them: an unnormalised row $p_n$ of finite
    values can still sum past the largest float32. Only $p_n$ can cause it, since
    the residual $\\max(p_n - q_n, 0)$ never exceeds $p_n$.
    """
    return row_mass == jnp.inf, RESULTS.target_row_overflows


def sampled_failure(token: Int[Array, " batch"], vocab: int) -> Failure:
    """The check that the sampler found a token, which fails only when the weights at
    the stopping position have no positive mass.
    """
    return (token < 0) | (token >= vocab), RESULTS.no_mass


def first_failure(failures: Sequence[Failure], batch: int) -> RESULTS:
    """Each row's first failing check, `failures` being in the order they are
    reported, or `successful`: one item per row."""
    result = jax.vmap(lambda _: RESULTS.successful)(jnp.zeros(batch))
    # From the last check to the first, so that the first failing one wins.
    for where, failure in reversed(failures):
        result = jax.vmap(RESULTS.where, in_axes=(0, None, 0))(where, failure, result)
    return result


def failure_messages(result: RESULTS) -> list[str]:
    """The message of each row's outcome, `""` for a successful row.

    **Arguments:**

    - `result`: the codes a step's `with_result` returns, one
        [`speculax.RESULTS`][] item per row, shape `(batch,)`; not traced (call this
        outside `jit`).

    **Returns:**

    A list of `batch` strings.

    **Example:**

    ```python
    import speculax

    _, result = speculax.SpeculativeStep(throw=False).with_result(
        draft_tokens=[[0], [5]],
        draft_probs=[[[0.5, 0.5]], [[0.5, 0.5]]],
        target_probs=[[[0.5, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]]],
        accept_uniforms=[[0.3], [0.3]],
        sample_uniforms=[0.6, 0.6],
    )
    first, second = speculax.failure_messages(result)
    assert first == ""
    assert second.startswith("draft_tokens must lie in [0, V)")
    ```
    """
    if result.is_traced():
        raise ValueError("failure_messages reads concrete codes; call it outside jit")
    (codes,) = jax.tree.leaves(result)
    rows = codes.shape
    if len(rows) != 1:
        raise ValueError(f"result must have shape (batch,); got {rows}")
    return [RESULTS[_row(result, b)] for b in range(rows[0])]


def _row(result: RESULTS, b: int) -> RESULTS:
    return jax.tree.map(lambda code: code[b], result)


_Output = TypeVar("_Output", bound=Mapping[str, Any])


def report_failures(
    output: _Output, result: RESULTS, *, check_values: bool, throw: bool
) -> tuple[_Output, RESULTS]:
    """A step's `output` dict and its rows' `result`, as the step's flags report
    them: unchanged without `check_values`; tied to one runtime error with `throw`;
    else with every failed row emptied."""
    # An empty batch has nothing to report, and Equinox's error needs an element.
    if not check_values or output["num_accepted"].shape[0] == 0:
        return output, result
    if throw:
        return raise_first_failure((output, result), result)
    return _empty_failed_rows(output, result), result


def _empty_failed_rows(output: _Output, result: RESULTS) -> _Output:
    """`output` with every failed row emptied, for `throw=False`: a count of 0
    (`num_accepted`) and `-1` in every other array."""
    failed = result != RESULTS.successful
    emptied: dict[str, Any] = {}
    for name, value in output.items():
        fill = 0 if name == "num_accepted" else -1
        row_failed = failed.reshape(failed.shape + (1,) * (value.ndim - 1))
        emptied[name] = jnp.where(row_failed, fill, value)
    return cast(_Output, emptied)


def raise_first_failure(x: PyTree, result: RESULTS) -> PyTree:
    """Ties `x` to one Equinox runtime error (a `RuntimeError`) with the message of
    the first failure over all rows (the largest index of [`speculax.RESULTS`][]),
    under `vmap` too.

    One branched error rather than one per check: each Equinox error is a
    conditional in the compiled program, and a dozen of them cost more, to compile
    and to run, than the checks themselves.
    """
    return result.error_if(x, result != RESULTS.successful)


def outside_unit_interval(u: Float[Array, "*shape"]) -> Array:
    return ~((u >= 0) & (u < 1))


def not_a_probability(x: Float[Array, "*shape"]) -> Array:
    return ~(jnp.isfinite(x) & (x >= 0))
