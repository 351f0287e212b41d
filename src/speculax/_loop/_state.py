"""What the loop carries from one step to the next, and what it returns."""

from typing import TypedDict, final

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int, PyTree, Shaped


class LoopOutput(TypedDict):
    """What [`speculax.SpeculativeLoop`][] returns: a plain `dict` with these keys,
    for $B$ rows, at most $N$ new tokens each.

    - `tokens`: int32 `(B, N)`, the generated tokens of each row, the end token
        included, then `-1`.
    - `num_tokens`: int32 `(B,)`, the number of generated tokens.
    - `num_steps`: int32 `(B,)`, the number of steps the row took, which is the number
        of target calls it needed.
    - `num_accepted`: int32 `(B, N)`, entry $[b, t]$ the number of draft tokens the
        step accepted for row $b$ in step $t$ (before the cut at $N$ tokens or
        after the end token), then `-1` once the row has finished.
    - `num_target_calls`: int32 scalar, the number of (batched) calls of the target
        model, the largest of `num_steps`.
    """

    tokens: Int[Array, "batch new"]
    num_tokens: Int[Array, " batch"]
    num_steps: Int[Array, " batch"]
    num_accepted: Int[Array, "batch new"]
    num_target_calls: Int[Array, ""]


@final
class LoopState(eqx.Module):
    """The carry of [`speculax.SpeculativeLoop`][] from one step to the next, for
    $B$ rows, prompts of width $P$, $N$ new tokens and $G$ drafts (for a tree,
    $G + 1$ is the loop's `round_slots`: the nodes and the root, or a dynamic
    tree's expanded nodes and the root if more).

    - `buffer`: int32 `(B, P + N + G + 1)`, each row's prompt and the tokens
        generated so far, its first `length` entries; past them it holds the last
        step's drafts or padding.
    - `prompt_length`: int32 `(B,)`, where each row's generated tokens begin.
    - `length`: int32 `(B,)`, the length of each row's history.
    - `done`: bool `(B,)`, whether the row has finished.
    - `num_steps`: int32 `(B,)`, the steps the row has taken.
    - `num_accepted`: int32 `(B, N)`, the draft tokens the step accepted in each
        step, `-1` for steps not taken.
    - `step`: int32 scalar, the number of steps taken by the batch.
    - `drafter_state`: the drafter's state (see [`speculax.AbstractDrafter`][]):
        for a draft model ([`speculax.ModelDrafter`][]) its cache, whose first
        `length - 2` slots hold the history (the round reads the last two tokens
        again, the draft having not read the last draft it proposed).
    - `target_cache`: the target model's cache (see
        [`speculax.AbstractCachedModel`][]), arrays of shape `(B, P + N + G + 1,
        ...)`, one slot per entry of the buffer, the first `length - 1` holding
        the history, all but its last token.
    - `temperature`, `top_k`, `top_p`: each row's sampling parameters, `(B,)` each,
        which the draft is drawn under and the step verifies by; `None` each for a
        loop given none and verifying with a [`speculax.SpeculativeStep`][] (the
        softmax of the logits as they are). `top_k` and `top_p` are also `None`
        where no row is truncated, as is known before tracing (neither given, or
        each a Python number that keeps all tokens), which leaves the threshold
        searches out of the loop's program.
    """

    buffer: Int[Array, "batch time"]
    prompt_length: Int[Array, " batch"]
    length: Int[Array, " batch"]
    done: Bool[Array, " batch"]
    num_steps: Int[Array, " batch"]
    num_accepted: Int[Array, "batch new"]
    step: Int[Array, ""]
    drafter_state: PyTree
    target_cache: PyTree[Shaped[Array, "batch time ..."]]
    temperature: Float[Array, " batch"] | None
    top_k: Int[Array, " batch"] | None
    top_p: Float[Array, " batch"] | None
