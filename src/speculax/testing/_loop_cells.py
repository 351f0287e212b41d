"""The cells of one step of the speculative sampling loop's random numbers: every
draft sequence, pattern of verdicts and drawn token from each state, with its
probability, found from the step's own pieces."""

import itertools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._chain._step import SpeculativeStep
from .._logits._step import LogitsStep
from .._loop._cache import Model, as_cached_model, read_history
from .._loop._drafter import AbstractDrafter, DraftRows, chain_lengths
from .._loop._keys import ACCEPT, DRAFT, SAMPLE
from .._loop._loop import SpeculativeLoop
from .._loop._model_drafter import history_logits
from .._loop._sampling import RowParameters, row_probs
from .._tree._abstract import AbstractTreeStep
from ._cells import (
    Cell,
    Leaf,
    Name,
    States,
    Use,
    cdf_edges,
    history_buffer,
    leaf_at_middle,
    narrowed,
)
from ._chain import (
    SamplerCells,
    acceptance_thresholds,
    fresh_probe_shifts,
    in_chunks,
    refuse_sampler,
    residual_weights,
    sampler_cells,
)


_MAX_LEAVES = 2_000_000


class _StepPieces(NamedTuple):
    """What the step's pieces give on every row of one step's enumeration, a row
    being a state followed by one of the $V^G$ draft sequences.

    - `rows`: the `(state, sequence)` indices of each row.
    - `sequences`: int32 `(V^G, G)`, every draft sequence.
    - `draft_cdf`: float64 `(rows, G, V + 1)`, the edges of each token's cell of
        $q_i$.
    - `thresholds`: `(rows, G)`, the uniform below which each test passes.
    - `monotone`: bool `(rows, G)`, whether each test is seen to pass exactly below
        its threshold.
    - `weights`: float64 `(rows, G + 1, V)`, the residual weights at every stopping
        position.
    - `cells`: the sampler's cells of `weights`, row `r * (G + 1) + n` for row $r$
        stopping after $n$ drafts.
    - `counts`: `(2^G,)`, the prefix count of each pattern of verdicts, in the
        order of `itertools.product([True, False])`.
    - `lengths`: `(rows,)`, the drafts in each row's chain: $G$, or fewer where
        deterministic drafts end early (`drawn_after` gives `-1` from there on).
    """

    rows: list[tuple[int, int]]
    sequences: np.ndarray
    draft_cdf: np.ndarray
    thresholds: np.ndarray
    monotone: np.ndarray
    weights: np.ndarray
    cells: SamplerCells
    counts: np.ndarray
    lengths: np.ndarray


def step_leaves(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: Model,
    prompt: tuple[int, ...],
    states: States,
    names: dict[int, list[Name]],
    parameters: RowParameters,
) -> list[Leaf]:
    """Every cell of one step's random numbers, from each state, with positive
    probability: each draft sequence narrows the `DRAFT` numbers, each pattern of
    verdicts the `ACCEPT` numbers, each drawn token the `SAMPLE` number, in the
    order the loop reads them.

    **Arguments:**

    - `loop`: the loop, with its step.
    - `drafter`: the [`speculax.AbstractDrafter`][].
    - `target_model`: a [`speculax.AbstractCachedModel`][] or a
        [`speculax.LanguageModel`][].
    - `prompt`: the prompt.
    - `states`: the states the step starts from.
    - `names`: the names of the step's random numbers, per stream.
    - `parameters`: the prompt's sampling parameters, `(1,)` each, or `None` each.

    **Returns:**

    The cells, as `Leaf`s.
    """
    pieces = _step_pieces(loop, drafter, target_model, prompt, states, parameters)
    patterns = list(itertools.product([True, False], repeat=loop.num_nodes))
    leaves = []
    for row, (state, sequence) in enumerate(pieces.rows):
        (_, constraints), probability = states[state]
        # A chain of deterministic drafts that ends early is read with the
        # placeholder 0 past its end, where its drafter gives -1.
        length = int(pieces.lengths[row])
        drafts = tuple(pieces.sequences[sequence].tolist())
        if any(drafts[length:]):
            continue
        drafted = narrowed(
            Cell(dict(constraints), probability),
            _draft_uses(pieces, names, row, drafts[:length]),
        )
        if drafted is None:
            continue
        drafts = drafts[:length] + (-1,) * (loop.num_nodes - length)
        if not pieces.monotone[row, :length].all():
            raise ValueError(
                f"{piece_name(loop, 'acceptance')} is not monotone in the uniform: "
                "a position "
                "passes at some u above the threshold found by bisection or fails at "
                "some u below it"
            )
        for pattern, count in zip(patterns, pieces.counts.tolist(), strict=True):
            # Past the chain's end the step tests nothing: its uniforms are free.
            if any(pattern[length:]):
                continue
            tested = narrowed(drafted, _test_uses(pieces, names, row, pattern[:length]))
            if tested is None:
                continue
            for token, uses in _sample_uses(loop, pieces, names, row, count):
                sampled = narrowed(tested, uses)
                if sampled is not None:
                    leaves.append(
                        leaf_at_middle(
                            state, sampled, names, drafts, drafts[:count], token
                        )
                    )
    return leaves


def _step_pieces(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: Model,
    prompt: tuple[int, ...],
    states: States,
    parameters: RowParameters,
) -> _StepPieces:
    """The step's pieces on every state followed by every draft sequence, run in
    chunks under `jit`, and the sampler's cells of their residual weights."""
    num_draft = loop.num_nodes
    sequences = _draft_sequences(loop, target_model, len(states))
    rows = [
        (state, sequence)
        for state in range(len(states))
        for sequence in range(len(sequences))
    ]
    histories = [
        prompt + states[state][0][0] + tuple(sequences[sequence].tolist())
        for state, sequence in rows
    ]
    buffer, lengths = history_buffer(
        histories, len(prompt) + loop.max_new_tokens + num_draft + 1
    )
    draft_probs, thresholds, monotone, weights, lengths = in_chunks(
        lambda buffer, lengths, tokens, shift: _run_step_pieces(
            loop,
            drafter,
            target_model,
            parameters,
            buffer,
            lengths,
            tokens,
            shift,
        ),
        buffer,
        lengths,
        sequences[[sequence for _, sequence in rows]],
        fresh_probe_shifts((len(rows), num_draft)),
    )
    weights = weights.astype(np.float64)
    return _StepPieces(
        rows=rows,
        sequences=sequences,
        draft_cdf=cdf_edges(draft_probs.astype(np.float64)),
        thresholds=thresholds,
        monotone=monotone,
        weights=weights,
        # The cells of s for every row and stopping position, from the sampler.
        cells=sampler_cells(
            verified_pieces(loop.step).sampler, weights.reshape(-1, weights.shape[-1])
        ),
        counts=np.asarray(_prefix_counts(verified_pieces(loop.step), num_draft)),
        lengths=lengths,
    )


def _draft_sequences(
    loop: SpeculativeLoop,
    target_model: Model,
    num_states: int,
) -> np.ndarray:
    """Every sequence of $G$ tokens, int32 `(V^G, G)`, after checking that the cells
    of `num_states` states are not too many to enumerate."""
    num_draft = loop.num_nodes
    model = as_cached_model(target_model, "target_model")
    vocab = jax.eval_shape(
        lambda tokens: history_logits(model, tokens, tokens),
        jax.ShapeDtypeStruct((1, 1), jnp.int32),
    ).shape[-1]
    sequences = np.array(
        list(itertools.product(range(vocab), repeat=num_draft)), np.int32
    ).reshape(vocab**num_draft, num_draft)
    if num_states * len(sequences) * 2**num_draft * vocab > _MAX_LEAVES:
        raise ValueError(
            f"{num_states} states x V^G draft sequences x 2^G verdicts x V tokens "
            f"(V = {vocab}, G = {num_draft}) is more than {_MAX_LEAVES} cells to "
            "enumerate in one step"
        )
    return sequences


def _draft_uses(
    pieces: _StepPieces,
    names: dict[int, list[Name]],
    row: int,
    drafts: tuple[int, ...],
) -> list[Use]:
    """The uses of the `DRAFT` numbers that draw `drafts` (the chain's first, or
    all) in row `row`: each in its token's cell of $q_i$."""
    return [
        (
            names[DRAFT][i],
            pieces.draft_cdf[row, i, token],
            pieces.draft_cdf[row, i, token + 1],
        )
        for i, token in enumerate(drafts)
    ]


def _test_uses(
    pieces: _StepPieces,
    names: dict[int, list[Name]],
    row: int,
    pattern: tuple[bool, ...],
) -> list[Use]:
    """The uses of the `ACCEPT` numbers that give the verdicts `pattern` (of the
    first drafts, or all) in row `row`: below its threshold for each test that
    passes, above for each that fails."""
    return [
        (name, 0.0, threshold) if passed else (name, threshold, 1.0)
        for name, threshold, passed in zip(
            names[ACCEPT][: len(pattern)],
            pieces.thresholds[row, : len(pattern)],
            pattern,
            strict=True,
        )
    ]


def _sample_uses(
    loop: SpeculativeLoop,
    pieces: _StepPieces,
    names: dict[int, list[Name]],
    row: int,
    count: int,
) -> list[tuple[int, list[Use]]]:
    """Each token the sampler draws in row `row` after `count` kept drafts, with the
    use of the `SAMPLE` number that draws it (none for a sampler that reads no
    uniform), after checking the residual weights and the sampler's cells there."""
    residual = pieces.weights[row, count]
    if not (np.all(np.isfinite(residual) & (residual >= 0)) and residual.sum()):
        raise ValueError(
            f"{piece_name(loop, 'residual')} returned weights that are negative, not "
            "finite or without positive mass, in a state reached with "
            "positive probability"
        )
    sampler, cells = verified_pieces(loop.step).sampler, pieces.cells
    cell = row * (loop.num_nodes + 1) + count
    if not cells.valid[cell]:
        raise refuse_sampler(piece_name(loop, "sampler"), sampler, cells, cell)
    # A sampler that reads no uniform (Argmax) leaves s unconstrained.
    return [
        (
            int(token),
            [(names[SAMPLE][0], low, high)] if sampler.reads_uniforms else [],
        )
        for low, high, token in zip(
            cells.lows[cell], cells.highs[cell], cells.tokens[cell], strict=True
        )
        if high > low
    ]


@eqx.filter_jit
def _run_step_pieces(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: Model,
    parameters: RowParameters,
    buffer: jax.Array,
    length: jax.Array,
    draft_tokens: jax.Array,
    probe_shift: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """For histories whose last $G$ tokens are the drafts, the rows the drafts are
    drawn from (`drafter.drawn_after`; the one-hot rows of deterministic drafts),
    and the step's pieces on the rows it verifies by: the acceptance thresholds,
    whether they are consistent, the residual weights at every stopping position
    (past the end of a chain of deterministic drafts that ends early, as the
    loop's step makes them of its ragged batch), and the drafts in each chain."""
    step = verified_pieces(loop.step)
    rows, num_draft = draft_tokens.shape
    parameters = per_row(parameters, rows)
    positions = (length - num_draft - 1)[:, None] + jnp.arange(num_draft + 1)
    target_logits, target_cache = read_history(
        as_cached_model(target_model, "target_model"),
        buffer,
        buffer.shape[1],
        "target_model",
    )
    target_logits = jnp.take_along_axis(target_logits, positions[..., None], axis=1)
    target_probs = row_probs(target_logits, parameters)
    drawn = drafter.drawn_after(
        buffer,
        length - num_draft,
        target_cache,
        num_draft,
        parameters,
        loop.draft_sampling,
    )
    lengths = None if isinstance(drawn, DraftRows) else chain_lengths(drawn)
    drawn, draft_probs = _draft_rows(
        loop, drawn, draft_tokens, parameters, target_probs.shape[-1]
    )
    if num_draft:
        thresholds, monotone = acceptance_thresholds(
            step.acceptance,
            draft_tokens,
            draft_probs,
            target_probs,
            probe_shift,
            lengths,
        )
    else:
        thresholds = jnp.zeros((rows, 0), jnp.float64)
        monotone = jnp.ones((rows, 0), jnp.bool_)
    weights = residual_weights(
        step.residual, draft_tokens, draft_probs, target_probs, lengths
    )
    if lengths is None:
        lengths = jnp.full((rows,), num_draft, jnp.int32)
    return drawn, thresholds, monotone, weights, lengths


def _draft_rows(
    loop: SpeculativeLoop,
    drawn: DraftRows | jax.Array,
    draft_tokens: jax.Array,
    parameters: RowParameters,
    vocab: int,
) -> tuple[jax.Array, jax.Array]:
    """The rows the drafts are drawn from and the rows the step verifies them by,
    from what `drafter.drawn_after` gives: for drafts drawn from rows, the
    drafter's rows, as they are for a SpeculativeStep and as a LogitsStep makes
    them of their logits; for deterministic drafts, the one-hot rows of the
    proposals (of the placeholder 0 past a chain's end) and of the drafts."""
    if isinstance(drawn, DraftRows):
        if isinstance(loop.step, LogitsStep):
            return drawn.probs, row_probs(drawn.logits, parameters)
        return drawn.probs, drawn.probs
    return (
        jax.nn.one_hot(jnp.maximum(drawn, 0), vocab, dtype=jnp.float64),
        jax.nn.one_hot(draft_tokens, vocab, dtype=jnp.float64),
    )


def per_row(parameters: RowParameters, batch: int) -> RowParameters:
    """The `(1,)` sampling parameters of the enumeration's prompt, one per row of a
    batch of its states."""
    return RowParameters(
        *(None if x is None else jnp.broadcast_to(x, (batch,)) for x in parameters)
    )


def verified_pieces(
    step: SpeculativeStep | LogitsStep | AbstractTreeStep,
) -> SpeculativeStep:
    """The pieces whose cells the enumeration finds: the step's own, or for a
    [`speculax.LogitsStep`][] those of rejection sampling, the rule it states for
    sampled rows, which on the one-hot rows of a greedy row is greedy
    verification. Every cell then checks what the LogitsStep did against them.
    A tree step has no chain pieces: `tree_step_leaves` walks its rule."""
    if isinstance(step, AbstractTreeStep):
        raise TypeError("a tree step's cells are found by walking its rule")
    return step if isinstance(step, SpeculativeStep) else SpeculativeStep()


def piece_name(loop: SpeculativeLoop, piece: str) -> str:
    """How an error names one of the pieces the enumeration evaluates."""
    if isinstance(loop.step, SpeculativeStep):
        return f"loop.step.{piece}"
    return f"the {piece} of the rule loop.step (a LogitsStep) states"


def _prefix_counts(step: SpeculativeStep, num_draft: int) -> jax.Array:
    """The prefix count of every pattern of verdicts, in the order of
    `itertools.product([True, False])`."""
    patterns = jnp.array(
        list(itertools.product([True, False], repeat=num_draft)), jnp.bool_
    ).reshape(2**num_draft, num_draft)
    return step.prefix(patterns)
