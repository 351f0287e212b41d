"""Exact output distributions of the speculative sampling loop: step after step, the
cells of its random numbers (from `_loop_cells`) run through the loop's own step, and
the target's distribution, sampled one token at a time, to compare them with."""

from collections import defaultdict
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike

from .._core._numerics import static_integer
from .._logits._step import LogitsStep
from .._loop._cache import AbstractCachedModel, Model, as_cached_model, read_history
from .._loop._drafter import AbstractDrafter, DraftRows, cut_chains, ended_chains
from .._loop._dynamic_tree import DynamicTree
from .._loop._keys import ACCEPT, DRAFT, SAMPLE, step_keys
from .._loop._loop import SpeculativeLoop
from .._loop._model import LanguageModel
from .._loop._model_drafter import as_drafter, history_logits
from .._loop._sampling import RowParameters, row_parameters, row_probs
from .._loop._state import LoopState
from .._loop._tree_round import drafted_tree
from .._tree._abstract import AbstractTreeStep
from ._cells import Constraints, Leaf, Name, States, history_buffer
from ._chain import in_chunks
from ._loop_caches import (
    Models,
    cache_faults,
    check_caches,
    check_drafter_state,
    filled_caches,
    scrambled_caches,
)
from ._loop_cells import (
    per_row,
    piece_name,
    step_leaves,
    verified_pieces,
)
from ._loop_tree_cells import tree_step_leaves


def loop_output_distribution(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter | AbstractCachedModel | LanguageModel,
    target_model: AbstractCachedModel | LanguageModel,
    prompt: Sequence[int],
    *,
    temperature: ArrayLike | None = None,
    top_k: ArrayLike | None = None,
    top_p: ArrayLike | None = None,
) -> dict[tuple[int, ...], float]:
    """Computes exactly the distribution of the tokens `loop` generates after one
    prompt, over every value of its random numbers, by running the loop's own step.

    Each random number is a uniform on $[0, 1)$, named by the key that
    `loop.key_schedule` (a [`speculax.AbstractKeySchedule`][]) gives it, for a row
    whose key is `jax.random.key(0)`, so that two uses with the same key read the
    same number: a schedule that reuses keys is enumerated as it
    runs, not as intended. Step by step, every use of a number narrows the interval
    it is known to lie in:

    - draft token $i$ is $x$ exactly when its `DRAFT` number falls in $x$'s cell of
        the cumulative distribution of $q_i$, the row
        [`speculax.AbstractDrafter.drawn_after`][] gives after the history and
        $x_{<i}$ (for a draft model, what `loop.draft_sampling` makes of its
        logits: by default their softmax, under the sampling parameters if any);
        for deterministic drafts, exactly when $x$ is the token it proposes,
        whatever the number, and a chain it ends early (`-1`) has no draft $i$
        past its end;
    - test $i$ passes exactly when its `ACCEPT` number lies below the threshold
        found by bisection on `loop.step.acceptance` (as
        [`speculax.testing.output_distribution`][] does); past a chain's end no
        test is made and the number is not read;
    - the drawn token is $y$ exactly when the `SAMPLE` number falls in the interval
        on which `loop.step.sampler` draws $y$ from the weights of
        `loop.step.residual` at the count `loop.step.prefix` gives (told where
        each chain ends), the intervals found by scanning the sampler (as
        [`speculax.testing.output_distribution`][] does: each token must be drawn on
        one interval, as by inverse CDF over the vocabulary in any order); a sampler
        that reads no uniform ([`speculax.Argmax`][]) leaves the number as it was.

    A cell's probability is the product, over its numbers, of the fraction of each
    one's interval that remains. [`SpeculativeLoop.advance`][speculax.SpeculativeLoop]
    is then called once per cell (all cells of a step as one batch), with every
    number at the middle of its interval, and its new history is the cell's outcome.
    It must have kept the drafts and drawn the token the cell implies, or the
    enumeration raises, naming the piece and what is assumed of it: a step whose
    pieces read their uniforms otherwise (a test reading another position's
    uniform, a sampler drawing a token on two intervals) would make the cells too
    coarse and the result wrong. Intervals of
    numbers that a later step reads again are carried into that step; the others are
    forgotten, and states with the same history and the same intervals are merged.

    Models with a cache ([`speculax.AbstractCachedModel`][]) have each state's
    caches filled with its history in one call. In every cell the enumeration
    checks, for each model, that this gives the loop's own outcome, and raises
    otherwise: the logits of the round's calls after the cached history are those of
    reading the whole history at once; the outcome does not change when the slots
    at or past `cache_length` hold other entries (the loop leaves rejected drafts
    there); and after the step the slots the next step reads as history hold what
    reading the new history in one call writes. The comparisons are for equality,
    which suits exact models; a float model whose entries depend, by rounding, on
    how many tokens a call read is refused.

    Everything runs under `jax.enable_x64(True)`, where the loop computes its
    probabilities in float64 whatever the dtype of the models' logits (see
    [`speculax.SpeculativeLoop`][]), and the enumeration computes them with the
    loop's own function: the result is the loop's distribution for the logits the
    models return, float16 and bfloat16 ones included, up to float64 rounding. The
    cost grows as $V^G$ per state and step: this is for small models, say
    $V \\le 5$, $G \\le 3$ and `max_new_tokens` $\\le 6$.

    **Arguments:**

    - `loop`: the [`speculax.SpeculativeLoop`][], with its step, $G$, end token and
        key schedule.
    - `drafter`: a [`speculax.AbstractDrafter`][], or a draft model, as the loop
        takes it. A drafter other than a draft model must keep no state (its
        state is filled afresh from each history, which is checked for a draft
        model's cache only).
    - `target_model`: a [`speculax.AbstractCachedModel`][] or a
        [`speculax.LanguageModel`][].
    - `prompt`: one prompt, a sequence of at least one token.
    - `temperature`, `top_k`, `top_p`: keyword only, the prompt's sampling
        parameters, as the loop takes them (a Python number or a scalar each):
        $q_i$ is then what `loop.draft_sampling` makes of the draft's logits, and
        the step's pieces read the rows it verifies by, the models' logits under
        these parameters. A [`speculax.LogitsStep`][] is enumerated by the pieces of
        the rule it states, rejection sampling on those rows, and checked against
        them at the middle of every cell: its own arithmetic is that of
        [`speculax.probs_from_logits`][] on the same logits, but a step that moved
        a threshold by less than half a cell would not be seen.

    **Returns:**

    A dict from each generated token sequence (up to `max_new_tokens` tokens, or
    fewer ending with the end token) to its probability; they sum to 1.

    **Raises:**

    `ValueError` for an empty prompt, a cache that fails a check above, an
    acceptance test seen not to be monotone in
    its uniform, residual weights without positive mass where they are drawn from, a
    sampler seen to draw a token on more than one interval of its uniform or a token
    outside $[0, V)$, a step that did not do in a cell what the cell implies, a
    drafter whose drafts or reported rows are not those `drawn_after` promises (from
    the caches as the history makes them, or with the slots past it scrambled), a
    drafter other than a draft model that keeps a state, or more than two million
    cells in one step.
    """
    prompt = _checked_prompt(prompt, target_model)
    models = (
        as_drafter(drafter),
        as_cached_model(target_model, "target_model"),
    )
    with jax.enable_x64(True):
        check_drafter_state(loop, models, jnp.asarray([prompt], jnp.int32))
        parameters = row_parameters(
            temperature,
            top_k,
            top_p,
            1,
            from_logits=isinstance(loop.step, LogitsStep),
        )
        names = [_uniform_names(loop, step) for step in range(loop.max_new_tokens)]
        states: dict[tuple[tuple[int, ...], Constraints], float] = {
            ((), frozenset()): 1.0
        }
        finished: defaultdict[tuple[int, ...], float] = defaultdict(float)
        for step in range(loop.max_new_tokens):
            if not states:
                break
            read_later = {
                name
                for later in names[step + 1 :]
                for stream in later.values()
                for name in stream
            }
            state_list = list(states.items())
            leaves = (step_leaves if loop.draft_tree is None else tree_step_leaves)(
                loop,
                *models,
                prompt,
                state_list,
                names[step],
                parameters,
            )
            generated, num_accepted, done = _outcomes(
                loop,
                models,
                prompt,
                state_list,
                leaves,
                step,
                parameters,
            )
            states = defaultdict(float)
            for leaf, tokens, leaf_num_accepted, leaf_done in zip(
                leaves, generated, num_accepted, done, strict=True
            ):
                _check_outcome(
                    loop,
                    leaf,
                    state_list[leaf.state][0][0],
                    tokens,
                    leaf_num_accepted,
                )
                if leaf_done:
                    finished[tokens] += leaf.probability
                    continue
                constraints = frozenset(
                    (name, interval)
                    for name, interval in leaf.intervals.items()
                    if name in read_later
                )
                states[tokens, constraints] += leaf.probability
    return dict(finished)


def target_output_distribution(
    target_model: AbstractCachedModel | LanguageModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    end_token: int | Sequence[int] | None = None,
    *,
    temperature: ArrayLike | None = None,
    top_k: ArrayLike | None = None,
    top_p: ArrayLike | None = None,
) -> dict[tuple[int, ...], float]:
    """Computes exactly the distribution of `max_new_tokens` tokens sampled from the
    target model one at a time after `prompt`, each from the softmax of its logits,
    stopping early after `end_token`: what a lossless loop must reproduce.

    Runs under `jax.enable_x64(True)`, like
    [`speculax.testing.loop_output_distribution`][], and takes the softmax as the
    loop does: of the logits' values, in float64 whatever their dtype. For a model
    with float16 or bfloat16 logits this is the softmax of those half-precision
    numbers, not a softmax rounded to half precision.

    **Arguments:**

    - `target_model`: a [`speculax.LanguageModel`][].
    - `prompt`: one prompt, a sequence of at least one token.
    - `max_new_tokens`: the number of tokens to sample.
    - `end_token`: the token that ends a sequence, a sequence of such tokens, or
        `None`.
    - `temperature`, `top_k`, `top_p`: keyword only, the sampling parameters, each
        a Python number or a scalar: each token is drawn from the target's logits
        under them, by [`speculax.probs_from_logits`][]. `None` each, the default,
        is the softmax of the logits.

    **Returns:**

    A dict from each token sequence to its probability.
    """
    prompt = _checked_prompt(prompt, target_model)
    end_tokens = () if end_token is None else np.atleast_1d(end_token).tolist()
    finished: dict[tuple[int, ...], float] = {}
    states = {(): 1.0}
    with jax.enable_x64(True):
        parameters = row_parameters(temperature, top_k, top_p, 1, from_logits=False)
        for _ in range(max_new_tokens):
            if not states:
                break
            histories = [prompt + generated for generated in states]
            buffer, lengths = history_buffer(histories, len(prompt) + max_new_tokens)
            (probs,) = in_chunks(
                lambda *rows: _next_token_probs(target_model, parameters, *rows),
                buffer,
                lengths,
            )
            next_states: dict[tuple[int, ...], float] = {}
            for (generated, probability), row in zip(
                states.items(), probs, strict=True
            ):
                for token in np.flatnonzero(row):
                    tokens = (*generated, int(token))
                    ended = token in end_tokens or len(tokens) == max_new_tokens
                    (finished if ended else next_states)[tokens] = float(
                        probability * row[token]
                    )
            states = next_states
    return finished


def loop_lossless_error(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter | AbstractCachedModel | LanguageModel,
    target_model: AbstractCachedModel | LanguageModel,
    prompt: Sequence[int],
    *,
    temperature: ArrayLike | None = None,
    top_k: ArrayLike | None = None,
    top_p: ArrayLike | None = None,
) -> float:
    """The total variation distance between the exact distribution of what `loop`
    generates after `prompt` and that of sampling the target model one token at a
    time: $\\frac{1}{2} \\sum_x |P_\\text{loop}(x) - P_\\text{target}(x)|$ over
    the token sequences $x$.

    From [`speculax.testing.loop_output_distribution`][] and
    [`speculax.testing.target_output_distribution`][], under their assumptions. A
    lossless loop gives rounding error only, about $10^{-15}$.

    **Arguments:**

    - `loop`: the loop to check.
    - `drafter`, `target_model`: as for
        [`speculax.testing.loop_output_distribution`][].
    - `prompt`: one prompt, a sequence of at least one token.
    - `temperature`, `top_k`, `top_p`: keyword only, the prompt's sampling
        parameters, given to both.

    **Returns:**

    The distance, a Python float in $[0, 1]$.
    """
    parameters = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    generated = loop_output_distribution(
        loop, drafter, target_model, prompt, **parameters
    )
    target = target_output_distribution(
        target_model, prompt, loop.max_new_tokens, loop.end_token, **parameters
    )
    return 0.5 * sum(
        abs(generated.get(tokens, 0.0) - target.get(tokens, 0.0))
        for tokens in generated.keys() | target.keys()
    )


def _checked_prompt(prompt: Sequence[int], target_model: Model) -> tuple[int, ...]:
    """The prompt as Python ints, after checking that it holds at least one token
    and that each is an integer (not a float or a bool), read by value, in
    $[0, V)$ for the target's vocabulary."""
    tokens = tuple(
        static_integer(token, f"prompt[{i}]") for i, token in enumerate(prompt)
    )
    if not tokens:
        raise ValueError("prompt must hold at least one token")
    model = as_cached_model(target_model, "target_model")
    buffer = jax.ShapeDtypeStruct((1, len(tokens)), jnp.int32)
    logits = jax.eval_shape(
        lambda b: read_history(model, b, len(tokens), "target_model")[0], buffer
    )
    vocab = logits.shape[-1]
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab:
            raise ValueError(
                f"prompt[{i}] must lie in [0, V) = [0, {vocab}); got {token}"
            )
    return tokens


@eqx.filter_jit
def _next_token_probs(
    model: Model,
    parameters: RowParameters,
    buffer: jax.Array,
    length: jax.Array,
) -> tuple[jax.Array]:
    cached = as_cached_model(model, "target_model")
    logits = history_logits(cached, buffer, (length - 1)[:, None])[:, 0]
    return (row_probs(logits, per_row(parameters, buffer.shape[0])),)


def _uniform_names(loop: SpeculativeLoop, step: int) -> dict[int, list[Name]]:
    """The name of each random number step `step` reads, per stream, for a row whose
    key is `jax.random.key(0)`."""
    n = loop.num_nodes
    # The keys as the loop derives them, in one vmapped call of the schedule.
    keys = step_keys(loop.key_schedule, jax.random.key(0), jnp.int32(step), n)
    names = [tuple(map(int, data)) for data in np.asarray(jax.random.key_data(keys))]
    return {DRAFT: names[:n], ACCEPT: names[n : 2 * n], SAMPLE: names[2 * n :]}


def _check_outcome(
    loop: SpeculativeLoop,
    leaf: Leaf,
    before: tuple[int, ...],
    after: tuple[int, ...],
    num_accepted: int,
) -> None:
    """Raises unless the loop's step did in `leaf` what its cell implies: kept the
    tokens `leaf.kept` and drew `leaf.sampled`, then cut to the room
    left and after the end token. A step that reads its uniforms otherwise than the
    enumeration assumes would make the result wrong, not just slow."""
    implied = [*leaf.kept, leaf.sampled]
    implied = implied[: loop.max_new_tokens - len(before)]
    ends = [k for k, token in enumerate(implied) if token in loop.end_tokens]
    if ends:
        implied = implied[: ends[0] + 1]
    added = list(after[len(before) :])
    if num_accepted == len(leaf.kept) and added == implied:
        return
    assumed = _assumption(loop, num_accepted != len(leaf.kept))
    raise ValueError(
        f"the exact enumeration assumes that {assumed}, and this one does not: at "
        f"uniforms where that implies {len(leaf.kept)} drafts kept and {implied} "
        f"appended, the loop's step kept {num_accepted} and appended {added}. Test "
        "such a piece statistically instead, as speculax.testing.lossless_chi_square "
        "does for a step"
    )


def _assumption(loop: SpeculativeLoop, count_differs: bool) -> str:
    """What the enumeration assumes of the piece at fault when the loop's step did
    not do what a cell implies: the count of kept drafts or the drawn token."""
    if isinstance(loop.step, AbstractTreeStep):
        return (
            f"loop.step (a {type(loop.step).__name__}) walks each tree by its rule, "
            "each child test passing exactly when its node's uniform lies below "
            "its threshold, and that loop.step.sampler draws each token on one "
            "interval of its uniform s"
        )
    if isinstance(loop.step, LogitsStep):
        return (
            "loop.step (a LogitsStep) verifies by the rule it states: rejection "
            "sampling on the rows speculax.probs_from_logits makes of both models' "
            "logits under the row's parameters"
        )
    pieces = verified_pieces(loop.step)
    if count_differs:
        return (
            f"each test of {piece_name(loop, 'acceptance')} "
            f"({type(pieces.acceptance).__name__}) passes exactly when its own "
            "uniform lies below a threshold (found by bisection)"
        )
    return (
        f"{piece_name(loop, 'sampler')} ({type(pieces.sampler).__name__}) draws "
        "each token on one interval of its uniform s (found by scanning it), as "
        "inverse-CDF sampling over the vocabulary in any order does"
    )


def _outcomes(
    loop: SpeculativeLoop,
    models: Models,
    prompt: tuple[int, ...],
    states: States,
    leaves: list[Leaf],
    step: int,
    parameters: RowParameters,
) -> tuple[list[tuple[int, ...]], list[int], list[bool]]:
    """Runs the loop's own step on every leaf, at the leaf's uniforms and under the
    prompt's sampling parameters, and reads the tokens generated so far, the drafts
    the step kept and whether the row has finished."""
    if not leaves:
        return [], [], []
    batch, num_draft = len(leaves), loop.num_nodes
    buffer, lengths = history_buffer(
        [prompt + states[leaf.state][0][0] for leaf in leaves],
        len(prompt) + loop.max_new_tokens + loop.round_slots,
    )
    outcome = in_chunks(
        lambda *rows: _advance(
            loop,
            *models,
            parameters,
            jnp.int32(len(prompt)),
            jnp.int32(step),
            *rows,
        ),
        buffer,
        lengths,
        np.array([leaf.draft_uniforms for leaf in leaves]).reshape(batch, num_draft),
        np.array([leaf.accept_uniforms for leaf in leaves]).reshape(batch, num_draft),
        np.array([leaf.sample_uniform for leaf in leaves]),
    )
    buffer, length, num_accepted, done, drafts, reported, faults, differences = outcome
    check_caches(faults, differences)
    _check_drafts(loop, leaves, drafts, reported)
    generated = [
        tuple(row[len(prompt) : row_length].tolist())
        for row, row_length in zip(buffer, length, strict=True)
    ]
    return generated, num_accepted.tolist(), done.tolist()


def _tiled_or_none(x: jax.Array | None, copies: int) -> jax.Array | None:
    return None if x is None else jnp.concatenate([x] * copies)


# How far the rows a drafter reports may lie from those it promises: rounding of
# float64 arithmetic done in another order, a few ulps. Rows moved by less move
# the output's distribution by less than N G V 1e-14 in total variation, below
# 1e-12 at the sizes the enumeration runs.
_ROWS_TOLERANCE = 1e-14


def _drafts(
    loop: SpeculativeLoop,
    models: Models,
    state: LoopState,
    draft_uniforms: jax.Array,
    parameters: RowParameters,
) -> tuple[jax.Array, jax.Array]:
    """The round's drafts as the loop's drafter makes them, int32 `(B, G)` (for a
    tree `(B, 2N)`, each node's token then each node's parent, `-1` for a node
    left out), and whether in each row the drafter reported the rows
    `drafter.drawn_after` gives after the history and the drafts before each (no
    rows for deterministic drafts), to within `_ROWS_TOLERANCE`, given the
    target's cache of the history and the drafts read whole: the rows the step
    verifies by are then those the drafts were drawn from."""
    drafter, target = models
    batch = state.length.shape[0]
    if loop.draft_tree is not None:
        drafted, *_ = drafted_tree(
            drafter, state, draft_uniforms, loop.draft_tree, loop.draft_sampling
        )
        tokens = jnp.where(drafted.parents >= 0, drafted.tokens, -1)
        return (
            jnp.concatenate([tokens, drafted.parents], axis=1),
            jnp.ones((batch,), jnp.bool_),
        )
    drafts = drafter.draft(state, draft_uniforms, loop.num_nodes, loop.draft_sampling)
    read, lengths = ended_chains(drafts)
    positions = state.length[:, None] + jnp.arange(loop.num_nodes)
    buffer = state.buffer.at[jnp.arange(batch)[:, None], positions].set(read.tokens)
    # What the loop verifies: a chain to its first -1, whatever follows it.
    if lengths is not None:
        drafts = drafts._replace(tokens=cut_chains(drafts.tokens, lengths, -1))
    _, target_cache = read_history(target, buffer, buffer.shape[1], "target_model")
    drawn = drafter.drawn_after(
        buffer,
        state.length,
        target_cache,
        loop.num_nodes,
        parameters,
        loop.draft_sampling,
    )
    if isinstance(drawn, DraftRows) != (drafts.rows is not None):
        return drafts.tokens, jnp.zeros((batch,), jnp.bool_)
    if drafts.rows is None:
        return drafts.tokens, jnp.ones((batch,), jnp.bool_)
    # Not bit for bit: a softmax computed in the round's loop and the same
    # softmax of a batch of rows round differently, by an ulp.
    same = [
        jnp.isclose(reported, expected, rtol=_ROWS_TOLERANCE, atol=_ROWS_TOLERANCE)
        .reshape(batch, -1)
        .all(axis=1)
        for reported, expected in zip(drafts.rows, drawn, strict=True)
    ]
    return drafts.tokens, same[0] & same[1]


def _check_drafts(
    loop: SpeculativeLoop, leaves: list[Leaf], drafts: np.ndarray, reported: np.ndarray
) -> None:
    """Raises unless the loop's drafter drew, in every leaf, the drafts its cell
    implies, from the rows it reported."""
    for leaf, drafted, as_drawn in zip(
        leaves, drafts.tolist(), reported.tolist(), strict=True
    ):
        if tuple(drafted) == leaf.drafts and as_drawn:
            continue
        if loop.draft_tree is not None:
            num_nodes = loop.draft_tree.num_nodes
            rule = (
                "grows the dynamic tree as speculax.DynamicTree defines it"
                if isinstance(loop.draft_tree, DynamicTree)
                else "fills the draft tree as loop.draft_tree.drafting says (node "
                "j's token by inverse CDF with DRAFT number j - 1, or by rank)"
            )
            raise ValueError(
                f"the exact enumeration assumes that the loop's drafter {rule}; at "
                f"uniforms where that gives the tokens {list(leaf.drafts[:num_nodes])} "
                f"and the parents {list(leaf.drafts[num_nodes:])}, it drafted the "
                f"tokens {drafted[:num_nodes]} and the parents {drafted[num_nodes:]}"
            )
        raise ValueError(
            "the exact enumeration assumes that the drafter draws draft i by "
            "inverse CDF, with DRAFT number i, from the row drawn_after gives after "
            "the history and the drafts before it (deterministic drafts: the token "
            "it gives), and reports those rows (none for deterministic drafts); at "
            f"uniforms where that gives the drafts {list(leaf.drafts)}, it drew "
            f"{drafted} and reported "
            + ("the rows it promised" if as_drawn else "other rows")
        )


@eqx.filter_jit
def _advance(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: AbstractCachedModel,
    parameters: RowParameters,
    prompt_length: jax.Array,
    step: jax.Array,
    buffer: jax.Array,
    length: jax.Array,
    draft_uniforms: jax.Array,
    accept_uniforms: jax.Array,
    sample_uniforms: jax.Array,
) -> tuple[jax.Array, ...]:
    """`loop.advance` on rows at `length` after a prompt of `prompt_length` tokens, in
    step `step`, under the prompt's sampling `parameters`, the drafter's state and
    the target's cache filled with the history: the new buffer, lengths, drafts
    kept and finished flags, the drafts and whether their rows are as reported (see
    `_drafts`), and the faults of each row's caches (see `cache_faults`)."""
    models = (drafter, target_model)
    batch = buffer.shape[0]
    parameters = per_row(parameters, batch)

    def before(caches: tuple, copies: int = 1) -> LoopState:
        def tiled(x: jax.Array) -> jax.Array:
            return jnp.concatenate([x] * copies)

        return LoopState(
            buffer=tiled(buffer),
            prompt_length=jnp.full((copies * batch,), prompt_length, jnp.int32),
            length=tiled(length),
            done=jnp.zeros((copies * batch,), jnp.bool_),
            num_steps=jnp.zeros((copies * batch,), jnp.int32),
            num_accepted=jnp.full((copies * batch, loop.max_new_tokens), -1, jnp.int32),
            step=jnp.int32(step),
            drafter_state=caches[0],
            target_cache=caches[1],
            temperature=_tiled_or_none(parameters.temperature, copies),
            top_k=_tiled_or_none(parameters.top_k, copies),
            top_p=_tiled_or_none(parameters.top_p, copies),
        )

    caches = filled_caches(loop, models, buffer)
    variants = [caches, *scrambled_caches(loop, models, buffer, length, caches)]
    # One call of the step for every variant of the caches, each a batch of rows:
    # a program with one copy of the step compiles in a fraction of the time.
    together = jax.tree.map(lambda *xs: jnp.concatenate(xs), *variants)
    uniforms = [
        jnp.concatenate([x] * len(variants))
        for x in (draft_uniforms, accept_uniforms, sample_uniforms)
    ]
    stacked = loop.advance(*models, before(together, len(variants)), *uniforms)
    after = [
        jax.tree.map(
            lambda x, k=k: x[k * batch : (k + 1) * batch] if x.ndim else x, stacked
        )
        for k in range(len(variants))
    ]
    # The drafter's round from every variant of the caches: a drafter reading the
    # target's entries past its history reports other rows from the scrambled ones.
    if loop.draft_tree is None:
        all_drafts, all_reported = _drafts(
            loop,
            models,
            before(together, len(variants)),
            uniforms[0],
            RowParameters(*(_tiled_or_none(x, len(variants)) for x in parameters)),
        )
        drafts = all_drafts[:batch]
        reported = all_reported.reshape(len(variants), batch).all(axis=0)
    else:
        drafts, reported = _drafts(
            loop, models, before(caches), draft_uniforms, parameters
        )
    faults, differences = cache_faults(
        loop, models, buffer, length, caches, after, drafts
    )
    after = after[0]
    return (
        after.buffer,
        after.length,
        after.num_accepted[:, step],
        after.done,
        drafts,
        reported,
        faults,
        differences,
    )
