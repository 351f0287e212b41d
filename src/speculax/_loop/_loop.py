"""The speculative sampling loop: draft, verify, append, repeat, under one `jit`."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Key

from .._chain._step import SpeculativeStep
from .._core._checks import check_static_int
from .._core._numerics import as_index, index_array, integer_by_value
from .._inputs._input_array import InputArray
from .._inputs._random import KeyArray, row_keys
from .._logits._step import LogitsStep
from .._pieces._acceptance import GreedyAcceptance
from .._tree._abstract import AbstractTreeStep
from .._tree._siblings import IndependentSiblings, SiblingsWithoutReplacement
from ._cache import AbstractCachedModel, as_cached_model, read_history
from ._chain_round import chain_round
from ._draft_tree import DraftTree
from ._drafter import AbstractDrafter
from ._dynamic_tree import DynamicTree
from ._keys import AbstractKeySchedule, FoldInKeys, step_keys
from ._model import LanguageModel
from ._model_drafter import as_drafter
from ._sampling import (
    AbstractDraftSampling,
    RowParameters,
    SameAsTarget,
    row_parameters,
)
from ._state import LoopOutput, LoopState
from ._tree_round import tree_round


def _end_token_ids(
    value: int | tuple[int, ...] | list[int] | None,
) -> int | tuple[int, ...] | None:
    """`end_token` as the loop keeps it, a static field: several ids as a tuple,
    which hashes, whatever sequence they came in; each read by value."""
    if isinstance(value, list | tuple):
        return tuple(integer_by_value(v) for v in value)
    return integer_by_value(value)


@final
class SpeculativeLoop(eqx.Module):
    """Speculative sampling: a drafter proposes $G$ tokens (or a draft model a tree
    of them), the target model scores them in one call, a verification step keeps some
    and draws one more, and the row's history grows by those tokens; repeated until
    each row has $N$ new tokens or has emitted the end token.

    Under `jit` throughout, as one `lax.while_loop` with fixed shapes: rows finish
    at different steps, and a finished row keeps its tokens while the others go on.
    Draft token $i$ is drawn from $q_i = \\mathrm{softmax}$ of the draft model's
    logits by inverse CDF (by default: `draft_sampling` decides), and $p_i$ is the
    softmax of the target's; with a
    lossless step (the default rejection sampling, block verification) the tokens
    are distributed exactly as if sampled from the target one at a time. With
    sampling parameters per row (temperature, top-$k$, top-$p$, given to the call),
    $p_i$ and $q_i$ are the models' logits under the row's parameters, as
    [`speculax.probs_from_logits`][] defines them, and the tokens are distributed as
    if sampled from the target under them. A drafter other than a draft model (a
    [`speculax.AbstractDrafter`][], such as [`speculax.PromptLookup`][]) gives its
    own rows, or deterministic drafts, which the step verifies as such.

    With a `draft_tree`, the draft model fills a [`speculax.DraftTree`][] level by
    level (a drafter without a state fills it from its rows: a node's children
    from the row of the next draft after the node's path, such as Medusa's head of
    the next depth), the target scores every node in one call with the ancestor
    mask, a tree step verifies it, and the accepted path's cache entries are moved
    to where the next round reads them; lossless when the tree step's sibling rule
    matches the tree's drafting. The drafter may instead grow each row's tree anew
    every round from its confidences, a [`speculax.DynamicTree`][] as EAGLE-2
    grows it: deterministic drafts, lossless with a [`speculax.TreeStep`][].

    A model may keep a cache, a [`speculax.AbstractCachedModel`][]: the loop fills
    it with the prompts in one call, and each round writes $G + 1$ slots of each
    model's cache (the tree's $N + 1$; `round_slots`) and reads no slot of a
    rejected draft, so
    that a call costs the new tokens, not the history. A plain
    [`speculax.LanguageModel`][], which reads the whole history at every call, is
    wrapped in [`speculax.Cacheless`][]; for the same keys the tokens are the same
    either way.

    The rows are computed in JAX's default float dtype (float32, float64 under
    x64), or in the logits' dtype if it is wider: never in half precision. The rows
    $q_i$ the draft is drawn from are the rows a [`speculax.SpeculativeStep`][]
    reads; a [`speculax.LogitsStep`][] is given the draft's logits in that same
    dtype, and makes the same rows from them. For a model with float16
    or bfloat16 logits, the target's distribution is the softmax of those
    half-precision numbers, and the loop samples it exactly, up to the rounding of
    float32 arithmetic.

    **Arguments:**

    The constructor takes, keyword only:

    - `max_new_tokens`: $N$, the number of tokens to generate per row, a positive
        static integer.
    - `num_draft`: $G$, the number of draft tokens per step of a chain, a
        non-negative static integer. $G = 0$ samples the target alone, one token
        per call.
    - `draft_tree`: a [`speculax.DraftTree`][] or a [`speculax.DynamicTree`][] to
        draft instead of a chain. Exactly one of `num_draft` and `draft_tree` is
        given.
    - `step`: the verification step. For a chain: a [`speculax.SpeculativeStep`][]
        (the default one, [`speculax.greedy_step`][], [`speculax.block_step`][], or
        any composition of pieces), given the rows $q_i$ and $p_i$; or a
        [`speculax.LogitsStep`][], given both models' logits and the rows'
        parameters, which makes no `(B, G + 1, V)` array of probabilities. For a
        tree: a [`speculax.TreeStep`][] or a [`speculax.TraversalStep`][], given
        the rows each node's children were drawn from (none for `"top-k"`
        drafting) and the target's rows under the row's parameters. A step of the
        other kind raises a `TypeError`. It must check values and raise
        (`check_values=True`, `throw=True`, the defaults). Default
        `SpeculativeStep()`.
    - `end_token`: a static token id that ends a row when generated, a tuple of
        them (any of which ends it, as serving engines take several end-of-sequence
        ids), or `None` (the default) for none.
    - `key_schedule`: the [`speculax.AbstractKeySchedule`][] of the random numbers;
        default
        [`speculax.FoldInKeys`][], under which none is used twice.
    - `draft_sampling`: the [`speculax.AbstractDraftSampling`][] that makes the
        rows $q_i$ the drafts are drawn from; default [`speculax.SameAsTarget`][],
        the draft model's logits under the row's parameters, the only one that is
        lossless with a [`speculax.LogitsStep`][].
    - `allow_lossy`: whether to run a composition the loop knows to be lossy,
        which it otherwise refuses with a `ValueError` that gives the reason: a
        tree step whose sibling rule is not the one of the tree's drafting
        ([`speculax.IndependentSiblings`][] for `"independent"`,
        [`speculax.SiblingsWithoutReplacement`][] for `"without replacement"`), or
        a greedy step ([`speculax.greedy_step`][]) called with sampling parameters
        other than a temperature of 0 given as a number (it decodes greedily,
        whatever the drafts were sampled under). For negative controls. Default
        `False`.

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp
    import speculax

    table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.3, 0.3, 0.4]]))

    def bigram(tokens, positions):
        # A Markov model: the next token's logits depend on the last token only.
        return table[jnp.take_along_axis(tokens, positions, axis=1)]

    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=8, end_token=2)
    out = loop(bigram, bigram, jnp.array([[0], [1]]), key=jax.random.key(0))
    assert out["tokens"].shape == (2, 8)
    # With the draft equal to the target, every draft token passes.
    assert (out["num_accepted"][:, 0] == 3).all()
    ```
    """

    max_new_tokens: int = eqx.field(
        static=True, kw_only=True, converter=integer_by_value
    )
    num_draft: int | None = eqx.field(
        static=True, default=None, kw_only=True, converter=integer_by_value
    )
    draft_tree: DraftTree | DynamicTree | None = eqx.field(default=None, kw_only=True)
    step: SpeculativeStep | LogitsStep | AbstractTreeStep = eqx.field(
        default=SpeculativeStep(), kw_only=True
    )
    end_token: int | tuple[int, ...] | None = eqx.field(
        static=True, default=None, kw_only=True, converter=_end_token_ids
    )
    key_schedule: AbstractKeySchedule = eqx.field(default=FoldInKeys(), kw_only=True)
    draft_sampling: AbstractDraftSampling = eqx.field(
        default=SameAsTarget(), kw_only=True
    )
    allow_lossy: bool = eqx.field(static=True, default=False, kw_only=True)

    def __check_init__(self):
        if self.draft_tree is not None and not isinstance(
            self.draft_tree, DraftTree | DynamicTree
        ):
            raise TypeError(
                "draft_tree must be a speculax.DraftTree, such as "
                'DraftTree(parents, drafting="independent"), or a '
                f"speculax.DynamicTree; got a {type(self.draft_tree).__name__}"
            )
        if (self.num_draft is None) == (self.draft_tree is None):
            raise ValueError(
                "give the loop exactly one of num_draft (a chain of G drafts) and "
                "draft_tree (a speculax.DraftTree or a speculax.DynamicTree)"
            )
        _check_step(self.step, self.draft_tree)
        if not self.allow_lossy:
            _check_sibling_rule(self.step, self.draft_tree)
        if self.num_draft is not None:
            check_static_int("num_draft", self.num_draft, minimum=0)
        check_static_int("max_new_tokens", self.max_new_tokens, minimum=1)
        if self.end_token is not None and not self.end_tokens:
            raise ValueError("end_token must hold at least one token id, or be None")
        for token in self.end_tokens:
            check_static_int("end_token", token, minimum=0)

    @property
    def end_tokens(self) -> tuple[int, ...]:
        """The token ids that end a row: `end_token` as a tuple, empty for `None`."""
        if self.end_token is None:
            return ()
        if isinstance(self.end_token, tuple):
            return self.end_token
        return (self.end_token,)

    @property
    def round_slots(self) -> int:
        """The slots of a cache from a history's last token on that a round may
        write: $G + 1$ for a chain, $N + 1$ for a tree, and for a
        [`speculax.DynamicTree`][] at least the $(D - 1) k + 1$ of a draft model's
        call of every expanded node. The buffer and the caches hold this many
        past the prompt and the new tokens."""
        tree = self.draft_tree
        if isinstance(tree, DynamicTree):
            return max(tree.num_nodes, (tree.depth - 1) * tree.top_k) + 1
        return self.num_nodes + 1

    @property
    def num_nodes(self) -> int:
        """The draft tokens of a round: $G$ for a chain, $N$ for a tree, and the
        number of uniforms a round reads from each of the `DRAFT` and `ACCEPT`
        streams."""
        if self.draft_tree is not None:
            return self.draft_tree.num_nodes
        assert self.num_draft is not None
        return self.num_draft

    def __call__(
        self,
        drafter: AbstractDrafter | AbstractCachedModel | LanguageModel,
        target_model: AbstractCachedModel | LanguageModel,
        prompt: InputArray,
        *,
        key: KeyArray,
        prompt_lengths: InputArray | None = None,
        temperature: ArrayLike | None = None,
        top_k: ArrayLike | None = None,
        top_p: ArrayLike | None = None,
    ) -> LoopOutput:
        """Generates up to `max_new_tokens` tokens after each prompt.

        **Arguments:**

        - `drafter`: what proposes the drafts, a [`speculax.AbstractDrafter`][]
            ([`speculax.PromptLookup`][], say), or a draft model on the target's
            vocabulary, which the loop drafts with as a
            [`speculax.ModelDrafter`][]. A draft tree is filled by a draft
            model, or by a drafter without a state (`drafter.init` gives
            `None`) from the rows its `drawn_after` promises; so is a dynamic
            tree grown.
        - `target_model`: a [`speculax.AbstractCachedModel`][], which reads only
            the new tokens at each call, or a [`speculax.LanguageModel`][], a
            callable `(tokens, positions) -> logits` that reads the whole history
            (the loop wraps it in [`speculax.Cacheless`][]). Models given as
            Equinox modules (or any PyTree of arrays) are traced, not baked in as
            constants.
        - `prompt`: integer `(B, P)`, the prompts, $P \\ge 1$.
        - `key`: keyword only, a JAX PRNG key, or one per row (shape `(B,)`) to make
            each row's tokens independent of the batch it runs in.
        - `prompt_lengths`: keyword only, integer `(B,)` in `[1, P]`: row $b$'s
            prompt is its first `prompt_lengths[b]` tokens. Default $P$ for all.
        - `temperature`, `top_k`, `top_p`: keyword only, each row's sampling
            parameters, as [`speculax.LogitsStep`][] takes them (a Python number, a
            scalar or one value per row, which may be traced): row $b$ samples the
            target under its own parameters, by the rule of
            [`speculax.probs_from_logits`][], and its drafts are drawn by
            `draft_sampling` (by default under the same parameters). Temperature 0
            is greedy decoding, in a batch with sampled rows. `None` each, the
            default, is the softmax of the logits as they are (temperature 1 and no
            truncation, computed as above).

        **Returns:**

        A [`speculax.LoopOutput`][] dict: `tokens` and `num_accepted` int32
        `(B, max_new_tokens)`, `num_tokens` and `num_steps` int32 `(B,)`, and
        `num_target_calls` an int32 scalar.

        **Raises:**

        `ValueError` or `TypeError` naming the argument for a prompt or lengths of
        the wrong shape or dtype, or a bad key; an Equinox runtime error for a
        prompt length outside `[1, P]` or a value the step's checks reject.
        """
        prompt, prompt_lengths = _index_inputs(prompt, prompt_lengths)
        if not self.allow_lossy:
            _check_greedy_parameters(self.step, temperature, top_k, top_p)
        parameters = row_parameters(
            temperature,
            top_k,
            top_p,
            prompt.shape[0],
            from_logits=isinstance(self.step, LogitsStep),
        )
        return _generate(
            self,
            as_drafter(drafter),
            as_cached_model(target_model, "target_model"),
            prompt,
            prompt_lengths,
            row_keys(key, prompt.shape[0]),
            parameters,
        )

    def start(
        self,
        drafter: AbstractDrafter | AbstractCachedModel | LanguageModel,
        target_model: AbstractCachedModel | LanguageModel,
        prompt: Int[Array, "batch prompt"],
        prompt_length: Int[Array, " batch"],
        *,
        temperature: ArrayLike | None = None,
        top_k: ArrayLike | None = None,
        top_p: ArrayLike | None = None,
    ) -> LoopState:
        """The state before the first step: the drafter's state after the prompts
        (`drafter.init`: a draft model's cache filled with them in one call) and the
        target's cache filled with them in one call.

        **Arguments:**

        - `drafter`, `target_model`: as for `__call__`.
        - `prompt`: int32 `(B, P)`, the prompts.
        - `prompt_length`: int32 `(B,)`, each in `[1, P]`.
        - `temperature`, `top_k`, `top_p`: keyword only, each row's sampling
            parameters, as for `__call__`.

        **Returns:**

        A [`speculax.LoopState`][] whose buffer holds each prompt, with room for
        `max_new_tokens` tokens and the drafts of one step beyond, with the
        drafter's state and the target's cache, a slot for each entry of the
        buffer.
        """
        if not self.allow_lossy:
            _check_greedy_parameters(self.step, temperature, top_k, top_p)
        parameters = row_parameters(
            temperature,
            top_k,
            top_p,
            prompt.shape[0],
            from_logits=isinstance(self.step, LogitsStep),
        )
        return _initial_state(
            self,
            as_drafter(drafter),
            as_cached_model(target_model, "target_model"),
            prompt,
            prompt_length,
            parameters,
        )

    def uniforms(
        self, row_key: Key[Array, " batch"], step: Int[Array, ""]
    ) -> tuple[
        Float[Array, "batch draft"], Float[Array, "batch draft"], Float[Array, " batch"]
    ]:
        """The uniforms of one step, each drawn from its key in `key_schedule`.

        **Arguments:**

        - `row_key`: `(B,)` typed keys, one per row.
        - `step`: int32 scalar, the step number $t$.

        **Returns:**

        `(draft_uniforms, accept_uniforms, sample_uniforms)` of shapes `(B, G)`,
        `(B, G)` and `(B,)` (`(B, N)`, `(B, N)` and `(B,)` for a tree of $N$
        nodes, node $j$ reading entry $j - 1$): the streams [`speculax.DRAFT`][],
        [`speculax.ACCEPT`][] and [`speculax.SAMPLE`][].
        """

        n = self.num_nodes

        def row(key: Key[Array, ""]) -> Float[Array, " uses"]:
            keys = step_keys(self.key_schedule, key, step, n)
            return jax.vmap(jax.random.uniform)(keys)

        uniforms = jax.vmap(row)(row_key)
        return uniforms[:, :n], uniforms[:, n : 2 * n], uniforms[:, 2 * n]

    def advance(
        self,
        drafter: AbstractDrafter | AbstractCachedModel | LanguageModel,
        target_model: AbstractCachedModel | LanguageModel,
        state: LoopState,
        draft_uniforms: Float[Array, "batch draft"],
        accept_uniforms: Float[Array, "batch draft"],
        sample_uniforms: Float[Array, " batch"],
    ) -> LoopState:
        """One step on every unfinished row, driven by the given uniforms: the
        drafter proposes $G$ tokens (a draft model fills a tree level by level),
        the target scores them with the
        target in one call, verify, and append the kept drafts (the accepted path)
        and the drawn token (as many as fit in `max_new_tokens`, cut after the end
        token).
        [`speculax.testing.loop_output_distribution`][] calls it with uniforms of
        its choosing.

        **Arguments:**

        - `drafter`, `target_model`: those `start` was given.
        - `state`: the [`speculax.LoopState`][] before the step.
        - `draft_uniforms`: float `(B, G)`, draft token $i$ drawn from $q_i$ by
            inverse CDF with uniform $i$; for a tree `(B, N)`, node $j$'s with
            uniform $j - 1$.
        - `accept_uniforms`: float `(B, G)`, the tests' $u_i$; for a tree
            `(B, N)`, node $j$'s coin at $j - 1$.
        - `sample_uniforms`: float `(B,)`, the drawn token's $s$.

        **Returns:**

        The [`speculax.LoopState`][] after the step. A finished row keeps its
        history and counts (its buffer past the history takes the step's drafts).
        """
        drafter = as_drafter(drafter)
        target = as_cached_model(target_model, "target_model")
        uniforms = (draft_uniforms, accept_uniforms, sample_uniforms)
        if self.draft_tree is not None:
            assert isinstance(self.step, AbstractTreeStep)
            return tree_round(
                drafter,
                target,
                state,
                uniforms,
                self.draft_tree,
                self.step,
                self.draft_sampling,
                self.max_new_tokens,
                self.end_tokens,
            )
        assert self.num_draft is not None
        assert isinstance(self.step, SpeculativeStep | LogitsStep)
        return chain_round(
            drafter,
            target,
            state,
            uniforms,
            self.num_draft,
            self.step,
            self.draft_sampling,
            self.max_new_tokens,
            self.end_tokens,
        )

    def output(self, state: LoopState) -> LoopOutput:
        """What the loop returns, read from a state.

        **Arguments:**

        - `state`: a [`speculax.LoopState`][], usually the last.

        **Returns:**

        A [`speculax.LoopOutput`][] dict.
        """
        positions = jnp.arange(self.max_new_tokens)
        num_tokens = state.length - state.prompt_length
        tokens = jnp.take_along_axis(
            state.buffer, state.prompt_length[:, None] + positions, axis=1
        )
        return {
            "tokens": jnp.where(positions < num_tokens[:, None], tokens, -1),
            "num_tokens": num_tokens,
            "num_steps": state.num_steps,
            "num_accepted": state.num_accepted,
            "num_target_calls": state.step,
        }


def _check_step(
    step: SpeculativeStep | LogitsStep | AbstractTreeStep,
    tree: DraftTree | DynamicTree | None,
) -> None:
    """Raises unless `step` suits the drafts (a tree step for a tree, a chain step
    otherwise) and the loop: whole rows, values checked and failures raised."""
    # Runtime type checking (jaxtyping with beartype) would catch a wrong kind, but
    # it is opt-in; without it the step would fail deep inside the first call.
    if tree is None and not isinstance(step, SpeculativeStep | LogitsStep):
        raise TypeError(
            "step must be a speculax.SpeculativeStep (the default, greedy_step(), "
            "block_step() or any composition of pieces) or a speculax.LogitsStep; "
            f"got a {type(step).__name__}. A tree step verifies a draft_tree"
        )
    if tree is not None and not isinstance(step, AbstractTreeStep):
        raise TypeError(
            "with a draft_tree, step must be a tree step, such as "
            "speculax.TreeStep(siblings=...) or speculax.TraversalStep(siblings=...) "
            f"with the sibling rule of the tree's drafting; got a "
            f"{type(step).__name__}"
        )
    if not isinstance(step, SpeculativeStep) and step.axis_name is not None:
        raise ValueError(
            "step.axis_name must be None: the loop calls its step on whole rows, "
            "not inside shard_map"
        )
    if not (step.check_values and step.throw):
        raise ValueError(
            "the loop needs a step that checks values and raises "
            "(check_values=True, throw=True): a row it could not verify would "
            "have no token to append"
        )


def _check_sibling_rule(
    step: SpeculativeStep | LogitsStep | AbstractTreeStep,
    tree: DraftTree | DynamicTree | None,
) -> None:
    """Raises if the tree step's sibling rule is one of the library's and not the
    one of the tree's drafting: the loop would be lossy."""
    if (
        tree is None
        or tree.drafting == "top-k"
        or not isinstance(step, AbstractTreeStep)
    ):
        return
    matching = {
        "independent": IndependentSiblings,
        "without replacement": SiblingsWithoutReplacement,
    }
    rule = type(step.siblings)
    expected = matching[tree.drafting]
    if rule in matching.values() and rule is not expected:
        raise ValueError(
            f"the draft tree's children are drawn {tree.drafting!r}, but the step "
            f"verifies them with {rule.__name__}, which is lossy for that drafting: "
            f"use {expected.__name__}() (or allow_lossy=True, for a negative "
            "control)"
        )


def _check_greedy_parameters(
    step: SpeculativeStep | LogitsStep | AbstractTreeStep,
    temperature: ArrayLike | None,
    top_k: ArrayLike | None,
    top_p: ArrayLike | None,
) -> None:
    """Raises if a greedy step is asked to sample under parameters: it decodes
    greedily whatever the drafts are drawn under, so the tokens would not follow
    the law the parameters ask for."""
    if not isinstance(step, SpeculativeStep) or not isinstance(
        step.acceptance, GreedyAcceptance
    ):
        return
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    asked = [name for name, value in given.items() if value is not None]
    if not asked or _is_number_zero(temperature):
        return
    raise ValueError(
        f"the step is greedy (greedy_step()) but the call gives {', '.join(asked)}: "
        "it would decode greedily, not sample under them. Pass temperature=0 for "
        "greedy decoding, use a LogitsStep, which is greedy exactly in the rows of "
        "temperature 0, or allow_lossy=True for a negative control"
    )


def _is_number_zero(value: ArrayLike | None) -> bool:
    """Whether `value` is known now, not traced, to be 0 in every row."""
    if value is None:
        return False
    try:
        return bool(np.all(np.asarray(value) == 0))
    except jax.errors.TracerArrayConversionError:
        return False


def _index_inputs(
    prompt: InputArray, prompt_lengths: InputArray | None
) -> tuple[Int[Array, "batch prompt"], Int[Array, " batch"]]:
    """The prompt and its lengths as int32 `(B, P)` and `(B,)` arrays (lengths $P$
    where `None`), after checking their shapes and dtypes, with errors that name
    them."""
    prompt = index_array(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(
            f"prompt must have shape (B, P) with P >= 1; got shape {prompt.shape}"
        )
    batch, prompt_width = prompt.shape
    if prompt_lengths is None:
        prompt_lengths = jnp.full((batch,), prompt_width, jnp.int32)
    prompt_lengths = index_array(prompt_lengths)
    if prompt_lengths.shape != (batch,):
        raise ValueError(
            f"prompt_lengths must have shape ({batch},), one per prompt; got shape "
            f"{prompt_lengths.shape}"
        )
    for name, array in (("prompt", prompt), ("prompt_lengths", prompt_lengths)):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array; got dtype {array.dtype}")
    return as_index(prompt), as_index(prompt_lengths)


@eqx.filter_jit
def _generate(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: AbstractCachedModel,
    prompt: Int[Array, "batch prompt"],
    prompt_length: Int[Array, " batch"],
    row_key: Key[Array, " batch"],
    parameters: RowParameters,
) -> LoopOutput:
    """The loop under `jit`: checks the prompt's lengths and tokens and the end token
    against the vocabulary, then advances every row until all are done."""
    prompt_length = eqx.error_if(
        prompt_length,
        (prompt_length < 1) | (prompt_length > prompt.shape[1]),
        f"prompt_lengths must lie in [1, P] = [1, {prompt.shape[1]}]",
    )
    slots = prompt.shape[1] + loop.max_new_tokens + loop.round_slots
    vocab = jax.eval_shape(
        lambda: read_history(target_model, prompt, slots, "target_model")[0]
    ).shape[-1]
    if loop.draft_tree is not None:
        loop.draft_tree.check_vocabulary(vocab)
    if any(token >= vocab for token in loop.end_tokens):
        raise ValueError(
            f"end_token must lie in [0, V) = [0, {vocab}); got {loop.end_token}"
        )
    in_prompt = jnp.arange(prompt.shape[1]) < prompt_length[:, None]
    prompt = eqx.error_if(
        prompt,
        in_prompt & ((prompt < 0) | (prompt >= vocab)),
        f"prompt tokens must lie in [0, V) = [0, {vocab})",
    )

    def body(state: LoopState) -> LoopState:
        return loop.advance(
            drafter, target_model, state, *loop.uniforms(row_key, state.step)
        )

    start = _initial_state(
        loop, drafter, target_model, prompt, prompt_length, parameters
    )
    final = jax.lax.while_loop(lambda state: ~state.done.all(), body, start)
    return loop.output(final)


def drafts_after_history(loop: SpeculativeLoop) -> int:
    """How many drafts after the history a round's rows are those of, as the
    drafter's `init` is told: $G$ for a chain, the depth $D$ of a draft tree."""
    return loop.num_nodes if loop.draft_tree is None else loop.draft_tree.depth


def _initial_state(
    loop: SpeculativeLoop,
    drafter: AbstractDrafter,
    target_model: AbstractCachedModel,
    prompt: Int[Array, "batch prompt"],
    prompt_length: Int[Array, " batch"],
    parameters: RowParameters,
) -> LoopState:
    """[`speculax.SpeculativeLoop.start`][] once its arguments are read: the
    buffer, the drafter's state and the target's cache after the prompts, and the
    parameters."""
    batch = prompt.shape[0]
    padding = jnp.zeros((batch, loop.max_new_tokens + loop.round_slots), jnp.int32)
    buffer = jnp.concatenate([prompt, padding], axis=1)
    slots = buffer.shape[1]
    target_logits, target_cache = read_history(
        target_model, prompt, slots, "target_model"
    )
    drafter_state = drafter.init(
        prompt, slots, drafts_after_history(loop), target_logits.shape[-1]
    )
    return LoopState(
        buffer=buffer,
        prompt_length=prompt_length,
        length=prompt_length,
        done=jnp.zeros((batch,), jnp.bool_),
        num_steps=jnp.zeros((batch,), jnp.int32),
        num_accepted=jnp.full((batch, loop.max_new_tokens), -1, jnp.int32),
        step=jnp.zeros((), jnp.int32),
        drafter_state=drafter_state,
        target_cache=target_cache,
        temperature=parameters.temperature,
        top_k=parameters.top_k,
        top_p=parameters.top_p,
    )
