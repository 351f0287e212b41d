"""Dynamic trees, grown each round as EAGLE-2 grows them: the growth against its
definition read literally and against the properties that make it a tree, the loop
lossless exactly and statistically with the shipped heads, a row alone as in a
batch, and the refusals."""

import dataclasses
from collections.abc import Callable
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Float
from scipy import stats

import speculax
from speculax._loop._dynamic_tree import grown_tree
from speculax.testing._loop_tree_cells import grown as grown_by_reading
from test_feature_heads import WIDTH, KeepsAState, eagle, medusa
from test_loop import STAT_TOKENS, sequence_counts


VOCAB = 3
TREE = speculax.DynamicTree(num_nodes=6, depth=3, top_k=2)
# In float32, which JAX keeps without x64 as with it.
EMBEDDING = np.random.default_rng(21).normal(size=(VOCAB, WIDTH)).astype(np.float32)


class PositionalMarkov(eqx.Module):
    """A model whose next token depends on the last two tokens and on the parity of
    the position: a tree node read with a wrong mask or at a wrong position gets
    other logits."""

    logits: Float[np.ndarray, "parity contexts vocab"]

    def __call__(self, tokens, positions):
        last = jnp.take_along_axis(tokens, positions, axis=1)
        before = jnp.take_along_axis(tokens, jnp.maximum(positions - 1, 0), axis=1)
        return jnp.asarray(self.logits)[positions % 2, before * VOCAB + last]


def positional(seed: int) -> speculax.Cacheless:
    """A `PositionalMarkov` model with random rows, its cache the buffer of the
    tokens it has read."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(VOCAB), size=(2, VOCAB**2))
    return speculax.Cacheless(PositionalMarkov(np.log(probs)))


def context_target() -> speculax.Cacheless:
    return positional(24)


@final
class Bounded(speculax.AbstractCachedModel):
    """A model whose cache refuses, at run time, a call that writes past its end
    (a model writing with `lax.dynamic_update_slice` would write below it instead,
    over the history)."""

    model: speculax.Cacheless

    def init_cache(self, batch, max_length):
        return self.model.init_cache(batch, max_length)

    def __call__(self, tokens, positions, mask, cache, cache_length):
        past_the_end = cache_length + tokens.shape[1] > cache.shape[1]
        cache_length = eqx.error_if(
            cache_length, past_the_end, "a call writes past the cache's end"
        )
        return self.model(tokens, positions, mask, cache, cache_length)


def draft_model() -> Bounded:
    """A draft model that reads its nodes' masks and positions as the target does."""
    return Bounded(positional(31))


def token_features(buffer):
    """The target's feature at a slot: a row of an embedding of the token there."""
    return jnp.asarray(EMBEDDING)[buffer]


def head(make: Callable) -> speculax.AbstractDrafter:
    """A shipped head on the features of `context_target`."""
    return dataclasses.replace(make(VOCAB), features=token_features)


def dynamic_loop(max_new_tokens: int) -> speculax.SpeculativeLoop:
    return speculax.SpeculativeLoop(
        draft_tree=TREE,
        step=speculax.TreeStep(),
        max_new_tokens=max_new_tokens,
        end_token=2,
    )


def tied_rows(count: int, vocab: int, seed: int) -> np.ndarray:
    """Random rows in which some tokens tie and some have probability 0, so that
    ranks and scores tie: at most `vocab - 2` tokens of positive probability."""
    rng = np.random.default_rng(seed)
    weights = rng.random((count, vocab))
    weights[:, 1] = weights[:, 3]
    weights[rng.random((count, vocab)) < 0.3] = 0
    weights[:, :2] = np.maximum(weights[:, :2], 0.05)
    weights[:, -2:] = 0
    return weights / weights.sum(axis=1, keepdims=True)


@pytest.mark.parametrize(
    "tree",
    [
        speculax.DynamicTree(num_nodes=10, depth=3, top_k=3),
        # Every candidate, those of probability 0 among them.
        speculax.DynamicTree(num_nodes=21, depth=3, top_k=3),
        speculax.DynamicTree(num_nodes=3, depth=1, top_k=3),
    ],
    ids=["10 of 21", "all 21", "depth 1"],
)
def test_a_grown_tree_is_its_definition(tree):
    batch, vocab, table = 5, 6, 64
    rows = tied_rows(table, vocab, seed=tree.num_nodes)
    # Each row's draft row after a path: a row of the table, by the path's tokens.
    weights = np.array([7, 31, 131])[: tree.depth]

    def index(b, padded):
        return (b * 977 + (padded * weights).sum(-1)) % table

    def rows_after(paths, depth, expanded, carried):
        return jnp.asarray(rows)[index(jnp.arange(batch)[:, None], paths)], carried

    def grow():
        root, _ = rows_after(jnp.zeros((batch, 1, tree.depth), jnp.int32), 0, 0, 0)
        return grown_tree(tree, root[:, 0], rows_after)[0]

    parents, tokens, _ = jax.jit(grow)()
    trees = set()
    for b in range(batch):

        def draft_row(path, b=b):
            return rows[index(b, np.array([*path, *[0] * (tree.depth - len(path))]))]

        expected_tokens, expected_parents = grown_by_reading(tree, draft_row)
        assert parents[b].tolist() == list(expected_parents)
        assert tokens[b].tolist() == list(expected_tokens)
        trees.add(expected_parents)
        # A tree: each parent before its child, siblings distinct, no node
        # scoring more than its parent, no path deeper than D.
        paths, scores = {0: ()}, {0: 0.0}
        for node, (parent, token) in enumerate(
            zip(parents[b].tolist(), tokens[b].tolist(), strict=True), start=1
        ):
            assert 0 <= parent < node
            paths[node] = (*paths[parent], token)
            with np.errstate(divide="ignore"):
                scores[node] = scores[parent] + np.log(draft_row(paths[parent])[token])
            assert scores[node] <= scores[parent]
        siblings = zip(parents[b].tolist(), tokens[b].tolist(), strict=True)
        assert len(set(siblings)) == tree.num_nodes
        assert len(paths[tree.num_nodes]) <= tree.depth
    # Each row grows its own tree.
    assert len(trees) > 1 or tree.num_nodes == tree.num_candidates


def tabled(root: np.ndarray, after: dict[int, np.ndarray], other: np.ndarray):
    """Rows of a tree of depth 2: `root` after the history, `after[t]` after the
    path `(t,)`, `other` after any other, as `grown_tree` and the reading take
    them."""
    by_first = np.stack([after.get(t, other) for t in range(len(root))])

    def rows_after(paths, depth, expanded=None, carried=None):
        rows = jnp.where(depth == 0, root, jnp.asarray(by_first)[paths[:, :, 0]])
        return rows, carried

    def draft_row(path):
        return root if not path else after.get(path[0], other)

    return rows_after, draft_row


X, Y = 0.7686825338221793, 0.15325676106938402
# Two adjacent float32 numbers whose logs round to the same float32.
LOW = np.float32(0.45000079)
HIGH = np.nextafter(LOW, np.float32(1))
ROW = np.array([0.5, 0.3, 0.2], np.float32)


@pytest.mark.parametrize(
    ("tree", "rows", "x64"),
    [
        # The score of (0, 1) is log X + log Y, and of (1,) log(X * Y): tied but
        # for rounding, with the cut between them.
        (
            speculax.DynamicTree(num_nodes=3, depth=2, top_k=2),
            tabled(
                np.array([X, X * Y, 1 - X - X * Y, 0, 0]),
                {0: np.array([0.5, Y, 0.12, 0.12, 0.5 - Y - 0.24])},
                np.array([0.4, 0.3, 0.2, 0.1, 0]),
            ),
            True,
        ),
        # The more likely token first, though the logs of the two tie.
        (
            speculax.DynamicTree(num_nodes=1, depth=1, top_k=1),
            tabled(np.array([LOW, HIGH, 1 - LOW - HIGH], np.float32), {}, ROW),
            False,
        ),
        # A row that sums to more than 1: no child above its parent.
        (
            speculax.DynamicTree(num_nodes=2, depth=2, top_k=2),
            tabled(
                np.array([0.6, 0.4, 0], np.float32),
                {1: np.array([1.5, 0, 0], np.float32)},
                ROW,
            ),
            False,
        ),
    ],
    ids=["scores tied but for rounding", "logs tied", "a row above 1"],
)
def test_a_grown_tree_is_its_reading_at_the_edges(tree, rows, x64):
    rows_after, draft_row = rows
    with jax.enable_x64(x64):
        root, _ = rows_after(jnp.zeros((1, 1, tree.depth), jnp.int32), 0)
        grown, _ = grown_tree(tree, root[:, 0], rows_after)
        tokens, parents = grown_by_reading(tree, draft_row)
    assert grown.parents[0].tolist() == list(parents)
    assert grown.tokens[0].tolist() == list(tokens)
    assert all(parent < node for node, parent in enumerate(parents, start=1))
    assert len(set(zip(parents, tokens, strict=True))) == tree.num_nodes
    if tree.num_nodes == 1:
        assert tokens == (1,)


@pytest.mark.parametrize(
    ("drafter", "parameters"),
    [
        # Paths accepted through nodes whose index is not their depth, whose
        # cache entries the round moves.
        (head(eagle), {}),
        (draft_model(), {}),
        # One of the head's three tokens of probability 0 in each row: scores of
        # minus infinity, kept and tied.
        pytest.param(
            head(eagle), {"temperature": 0.7, "top_k": 2}, marks=pytest.mark.slow
        ),
        pytest.param(head(medusa), {}, marks=pytest.mark.slow),
    ],
    ids=["EAGLE", "a draft model", "EAGLE, top-k sampling", "Medusa"],
)
def test_a_dynamic_tree_loop_is_lossless_exactly(drafter, parameters):
    error = speculax.testing.loop_lossless_error(
        dynamic_loop(4), drafter, context_target(), [1, 0], **parameters
    )
    assert error < 1e-12


@pytest.mark.slow
def test_the_exact_test_refuses_a_tree_grown_otherwise(monkeypatch):
    import speculax._loop._tree_round as tree_round

    def first_candidates(tree, root_row, rows_after, carried=None):
        # The first N candidates by number, not the N of highest score.
        wider = speculax.DynamicTree(
            num_nodes=tree.num_candidates, depth=tree.depth, top_k=tree.top_k
        )
        grown, carried = grown_tree(wider, root_row, rows_after, carried)
        return type(grown)(*(x[:, : tree.num_nodes] for x in grown)), carried

    monkeypatch.setattr(tree_round, "grown_tree", first_candidates)
    # Three tokens: a program of its own, traced with the wrong growth.
    with pytest.raises(ValueError, match="grows the dynamic tree as"):
        speculax.testing.loop_output_distribution(
            dynamic_loop(3), head(eagle), context_target(), [1, 0]
        )


@pytest.mark.slow
def test_jitted_dynamic_tree_loop_samples_the_target():
    loop, target = dynamic_loop(STAT_TOKENS), context_target()
    observed, expected = sequence_counts(loop, head(eagle), target)
    assert stats.chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize(
    "drafter",
    # The draft model's cache reads each row's own tree: in the default tier.
    [pytest.param(head(eagle), marks=pytest.mark.slow), draft_model()],
    ids=["EAGLE", "a draft model"],
)
def test_a_row_of_a_dynamic_tree_loop_is_the_row_alone(drafter):
    loop = dynamic_loop(6)
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, 3, size=(5, 4)))
    keys = jax.random.split(jax.random.key(2), 5)
    target = context_target()
    batch = loop(drafter, target, prompt, key=keys, temperature=0.8)
    alone = loop(drafter, target, prompt[3:4], key=keys[3:4], temperature=0.8)
    for name, value in alone.items():
        if name != "num_target_calls":
            np.testing.assert_array_equal(value, batch[name][3:4])


def test_a_draft_model_has_room_for_every_node_it_expands():
    # (3 - 1) * 3 = 6 expanded nodes, read in one call: more than the 3 draft
    # nodes and the root, from the last token of a history of up to 4 tokens.
    loop = speculax.SpeculativeLoop(
        draft_tree=speculax.DynamicTree(num_nodes=3, depth=3, top_k=3),
        step=speculax.TreeStep(),
        max_new_tokens=3,
    )
    assert loop.round_slots == 7
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, size=(8, 2)))
    keys = jax.random.split(jax.random.key(3), 8)
    out = loop(draft_model(), Bounded(context_target()), prompt, key=keys)
    assert (out["num_tokens"] == 3).all()


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"num_nodes": 11, "depth": 2, "top_k": 2}, ValueError, "at most the"),
        ({"num_nodes": 2, "depth": 0, "top_k": 2}, ValueError, "depth must be"),
        ({"num_nodes": 2, "depth": 2, "top_k": 2.0}, TypeError, "top_k"),
        ({"num_nodes": np.int8(6), "depth": 2, "top_k": 2}, None, None),
    ],
    ids=["more nodes than candidates", "depth 0", "a float", "a NumPy integer"],
)
def test_bad_construction(arguments, error, match, without_runtime_type_checks):
    if error is None:
        assert speculax.DynamicTree(**arguments).num_nodes == 6
        return
    with pytest.raises(error, match=match):
        speculax.DynamicTree(**arguments)


@pytest.mark.parametrize(
    ("drafter", "tree", "error", "match"),
    [
        (lambda: KeepsAState(head(medusa)), TREE, TypeError, "KeepsAState keeps one"),
        (speculax.PromptLookup, TREE, TypeError, "PromptLookup drafts deterministic"),
        (
            lambda: head(eagle),
            speculax.DynamicTree(num_nodes=4, depth=2, top_k=4),
            ValueError,
            "top_k = 4 is more than the V = 3",
        ),
    ],
    ids=["a state", "deterministic drafts", "more children than tokens"],
)
def test_the_loop_refuses_a_dynamic_tree_it_cannot_grow(drafter, tree, error, match):
    loop = speculax.SpeculativeLoop(
        draft_tree=tree, max_new_tokens=2, step=speculax.TreeStep()
    )
    with pytest.raises(error, match=match):
        loop(
            drafter(),
            context_target(),
            jnp.zeros((1, 2), jnp.int32),
            key=jax.random.key(0),
        )
