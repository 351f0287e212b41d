"""The loop with models that keep a cache: the same tokens as without one, bit for
bit; lossless by exact enumeration; the enumeration refusing a cache that reads or
keeps a rejected draft; and the interface's checks."""

import functools
from typing import Literal, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Bool, Float, Int
from scipy import stats

import speculax
import speculax.testing
from test_loop import STAT_TOKENS, MarkovModel, markov_pair, sequence_counts


Fault = Literal["reads rejected drafts", "writes nothing", "overwrites the history"]


@final
class CachedMarkovModel(speculax.AbstractCachedModel):
    """`MarkovModel` with a cache of the tokens it has read: the next token depends
    on the last `context` tokens, each found among the new tokens a token sees or,
    before them, in the cache.

    A `fault` makes it wrong in one of the ways a cache goes wrong: reading a slot
    past `cache_length` wherever the cache has an entry (a rejected draft's, after a
    rejection), never writing the new tokens (the next call reads the slots as they
    were), or writing the first new token over the history's last slot as well.
    """

    logits: Float[np.ndarray, "contexts vocab"]
    context: int = eqx.field(static=True)
    fault: Fault | None = eqx.field(static=True, default=None)

    def init_cache(self, batch: int, max_length: int) -> Int[Array, "batch slots"]:
        return jnp.full((batch, max_length), -1, jnp.int32)

    def __call__(
        self,
        tokens: Int[Array, "batch new"],
        positions: Int[Array, "batch new"],
        mask: Bool[Array, "batch new new"],
        cache: Int[Array, "batch slots"],
        cache_length: Int[Array, " batch"],
    ) -> tuple[Float[Array, "batch new vocab"], Int[Array, "batch slots"]]:
        vocab = self.logits.shape[-1]
        row = jnp.zeros(positions.shape, jnp.int32)
        for back in range(self.context):
            earlier = jnp.maximum(positions - back, 0)
            # The new token at that position among those each one sees, if any.
            seen = mask & (positions[:, None, :] == earlier[:, :, None])
            new = jnp.sum(jnp.where(seen, tokens[:, None, :], 0), axis=-1)
            cached = jnp.take_along_axis(cache, earlier, axis=1)
            if self.fault == "reads rejected drafts":
                token = jnp.where(cached >= 0, cached, new)
            else:
                token = jnp.where(seen.any(axis=-1), new, cached)
            row = row * vocab + token
        if self.fault != "writes nothing":
            slots = cache_length[:, None] + jnp.arange(tokens.shape[1])
            cache = cache.at[jnp.arange(tokens.shape[0])[:, None], slots].set(tokens)
        if self.fault == "overwrites the history":
            last = jnp.maximum(cache_length - 1, 0)
            written = jnp.where(cache_length > 0, tokens[:, 0], cache[:, 0])
            cache = cache.at[jnp.arange(tokens.shape[0]), last].set(written)
        return jnp.asarray(self.logits)[row], cache


def cached(model: MarkovModel, fault: Fault | None = None) -> CachedMarkovModel:
    return CachedMarkovModel(model.logits, model.context, fault)


@functools.cache
def bit_for_bit_loop(num_draft: int) -> speculax.SpeculativeLoop:
    return speculax.SpeculativeLoop(num_draft=num_draft, max_new_tokens=12, end_token=3)


def cached_equals_cacheless(
    loop: speculax.SpeculativeLoop, which: str, seed: int
) -> dict[str, np.ndarray]:
    """Runs `loop` on 48 rows of a Markov pair of the last two tokens, with the
    cache on `which` model ("both", "target" or "draft") and without, asserts the
    outputs equal bit for bit, and returns the cached one's."""
    draft, target = markov_pair(4, 2, seed=seed)
    rows = 48
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, 4, size=(rows, 3)))
    # Prompts of one token too: the draft then reads one token, not two, first.
    lengths = jnp.asarray(rng.integers(1, 4, size=rows))
    keys = jax.random.split(jax.random.key(seed), rows)
    plain = loop(draft, target, prompt, key=keys, prompt_lengths=lengths)
    models = {
        "both": (cached(draft), cached(target)),
        "target": (draft, cached(target)),
        "draft": (cached(draft), target),
    }[which]
    out = loop(*models, prompt, key=keys, prompt_lengths=lengths)
    for name in plain:
        np.testing.assert_array_equal(out[name], plain[name], err_msg=name)
    return {name: np.asarray(value) for name, value in out.items()}


@pytest.mark.parametrize(
    ("num_draft", "which"),
    [
        (3, "both"),
        # Fewer drafts, and one model with a cache beside one without, each once:
        # the extended tier.
        pytest.param(0, "target", marks=pytest.mark.slow),
        pytest.param(1, "draft", marks=pytest.mark.slow),
    ],
)
def test_cached_loop_gives_the_cacheless_tokens_bit_for_bit(num_draft, which):
    out = cached_equals_cacheless(bit_for_bit_loop(num_draft), which, num_draft)
    # Not vacuous: rows of every length, with drafts rejected and kept.
    if num_draft:
        accepted = np.asarray(out["num_accepted"])
        assert (accepted == 0).any() and (accepted == num_draft).any()
    assert len(set(np.asarray(out["num_tokens"]).tolist())) > 1


def test_a_cached_model_read_whole_is_the_model_without_a_cache():
    """`FullRead` of the cached Markov model gives the plain model's logits at any
    positions of any buffer, even with a cache that writes nothing (one call
    reads everything); and the loop given it gives the cached loop's tokens bit for
    bit, the check the docs recommend for a new cached model (which a faulty cache
    fails: `test_a_faulty_cache_changes_the_tokens`)."""
    draft, target = markov_pair(4, 2, seed=3)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 4, size=(5, 7)), jnp.int32)
    positions = jnp.asarray(rng.integers(0, 7, size=(5, 3)), jnp.int32)
    want = target(tokens, positions)
    for fault in (None, "writes nothing"):
        got = speculax.FullRead(cached(target, fault))(tokens, positions)
        np.testing.assert_array_equal(got, want, err_msg=str(fault))
    # The shapes of the cached loop's test above, whose compilation it shares.
    loop = bit_for_bit_loop(3)
    prompt = jnp.asarray(rng.integers(0, 4, size=(48, 3)))
    lengths = jnp.asarray(rng.integers(1, 4, size=48))
    keys = jax.random.split(jax.random.key(3), 48)
    models = {
        "whole": (speculax.FullRead(cached(draft)), speculax.FullRead(cached(target))),
        "cached": (cached(draft), cached(target)),
    }
    whole, out = (
        loop(*pair, prompt, key=keys, prompt_lengths=lengths)
        for pair in models.values()
    )
    for name in out:
        np.testing.assert_array_equal(out[name], whole[name], err_msg=name)


@pytest.mark.slow
def test_a_faulty_cache_changes_the_tokens():
    # What the enumeration refuses below is a real fault of the jitted loop too.
    draft, target = markov_pair(4, 2, seed=1)
    loop = bit_for_bit_loop(3)
    prompt = jnp.zeros((32, 2), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 32)
    plain = loop(draft, target, prompt, key=keys)["tokens"]
    for fault in ("reads rejected drafts", "writes nothing"):
        models = (cached(draft, fault), cached(target, fault))
        tokens = loop(*models, prompt, key=keys)["tokens"]
        assert (np.asarray(tokens) != np.asarray(plain)).any(), fault


@pytest.mark.parametrize(
    ("num_draft", "end_token", "step"),
    [
        # The enumeration's cache checks run in the default tier below.
        pytest.param(2, None, speculax.SpeculativeStep(), marks=pytest.mark.slow),
        pytest.param(1, 2, speculax.block_step(), marks=pytest.mark.slow),
    ],
    ids=["G2", "block G1 end"],
)
def test_cached_loop_is_lossless_exactly(num_draft, end_token, step):
    draft, target = markov_pair(3, 2, seed=num_draft)
    loop = speculax.SpeculativeLoop(
        num_draft=num_draft, max_new_tokens=4, end_token=end_token, step=step
    )
    error = speculax.testing.loop_lossless_error(
        loop, cached(draft), cached(target), [1, 0]
    )
    assert error < 1e-12


@pytest.mark.parametrize(
    ("fault", "faulty", "match"),
    [
        ("reads rejected drafts", "target", "target_model's cache is read at or past"),
        pytest.param(
            "reads rejected drafts",
            "draft",
            "draft_model's cache is read at or past",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "writes nothing",
            "target",
            "target_model gives other logits",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "writes nothing",
            "draft",
            "draft_model gives other logits",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "overwrites the history",
            "target",
            "target_model's cache after a step differs",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "overwrites the history",
            "draft",
            "draft_model's cache after a step differs",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_exact_test_refuses_a_faulty_cache(fault, faulty, match):
    draft, target = markov_pair(3, 2, seed=2)
    models = {"draft": cached(draft), "target": cached(target)}
    models[faulty] = cached(models[faulty], fault)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=match):
        speculax.testing.loop_output_distribution(
            loop, models["draft"], models["target"], [1, 0]
        )


@pytest.mark.slow
def test_jitted_cached_loop_samples_the_target():
    draft, target = markov_pair(3, 1, seed=11)
    loop = speculax.SpeculativeLoop(
        num_draft=3, max_new_tokens=STAT_TOKENS, end_token=2
    )
    observed, expected = sequence_counts(loop, cached(draft), cached(target))
    assert len(observed) > 15
    assert stats.chisquare(observed, expected).pvalue > 1e-3


MARKOV = MarkovModel(np.zeros((3, 3)), 1)


@final
class WrongLayout(speculax.AbstractCachedModel):
    """A cache with the slots on the wrong axis."""

    def init_cache(self, batch, max_length):
        return jnp.zeros((max_length, batch), jnp.int32)

    def __call__(self, tokens, positions, mask, cache, cache_length):
        return jnp.zeros((*tokens.shape, 3)), cache


def test_loop_refuses_a_cache_of_the_wrong_layout():
    loop = speculax.SpeculativeLoop(num_draft=1, max_new_tokens=2)
    prompt = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"target_model.init_cache\(2, 5\) must"):
        loop(
            MarkovModel(np.zeros((3, 3)), 1),
            WrongLayout(),
            prompt,
            key=jax.random.key(0),
        )


def test_loop_refuses_a_model_that_is_not_one():
    loop = speculax.SpeculativeLoop(num_draft=1, max_new_tokens=2)
    # With runtime type checking on (as in the tests), it fails there, naming it too.
    with pytest.raises(TypeError, match="drafter"):
        loop(
            3,
            MarkovModel(np.zeros((3, 3)), 1),
            jnp.zeros((1, 1), jnp.int32),
            key=jax.random.key(0),
        )


Misbehaviour = Literal[
    "no cache", "cache a slot short", "logits of (B, V)", "int", "rounds"
]


@final
class Misbehaving(speculax.AbstractCachedModel):
    """A `CachedMarkovModel` that returns what the interface does not ask for."""

    model: CachedMarkovModel
    how: Misbehaviour = eqx.field(static=True)

    def init_cache(self, batch: int, max_length: int) -> Int[Array, "batch slots"]:
        return self.model.init_cache(batch, max_length)

    def __call__(self, tokens, positions, mask, cache, cache_length):
        logits, cache = self.model(tokens, positions, mask, cache, cache_length)
        return {
            "no cache": logits,
            "cache a slot short": (logits, cache[:, :-1]),
            "logits of (B, V)": (logits[:, -1], cache),
            "int": (logits.astype(jnp.int32), cache),
            # Off by 1e-6 after a cached history, as float attention summed in
            # another order is.
            "rounds": (logits + 1e-6 * (cache_length > 0)[:, None, None], cache),
        }[self.how]


def _interface_cases() -> list:
    draft, target = markov_pair(3, 1, seed=0)
    wide = MarkovModel(np.zeros((3, 4)), 1)
    return [
        # (which model, the model, error, message)
        (
            "draft",
            lambda t, p: draft(t, p)[:, :-1],
            ValueError,
            r"draft_model\(tokens, positions\) must return logits of shape "
            r"\(B, K, V\) = \(2, 2, V\).*got of shape \(2, 1, 3\)",
        ),
        (
            "draft",
            lambda t, p: draft(t, jnp.concatenate([p, p], 1)),
            ValueError,
            "2, 4, 3",
        ),
        ("draft", lambda t, p: draft(t, p)[:, 0], ValueError, r"got of shape \(2, 3\)"),
        (
            "target",
            Misbehaving(cached(target), "no cache"),
            TypeError,
            r"target_model must return a pair \(logits, cache\).*got of shape",
        ),
        (
            "target",
            Misbehaving(cached(target), "cache a slot short"),
            ValueError,
            r"target_model must return its cache with the shapes and dtypes it was "
            r"given; got an array of shape \(2, 7\) and dtype int32 for one of "
            r"shape \(2, 8\)",
        ),
        (
            "target",
            Misbehaving(cached(target), "logits of (B, V)"),
            ValueError,
            r"target_model\(tokens, positions, ...\) must return logits",
        ),
        ("target", Misbehaving(cached(target), "int"), TypeError, "floating-point"),
        (
            "target",
            wide,
            ValueError,
            "must score the same vocabulary: draft_model gives logits over V = 3 "
            "tokens, target_model over V = 4",
        ),
    ]


@pytest.mark.parametrize("case", range(8))
def test_a_model_that_breaks_the_interface_is_named(case):
    which, bad, error, match = _interface_cases()[case]
    draft, target = markov_pair(3, 1, seed=0)
    models = {"draft": draft, "target": target, which: bad}
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=3)
    with pytest.raises(error, match=match):
        loop(
            models["draft"],
            models["target"],
            jnp.zeros((2, 2), jnp.int32),
            key=jax.random.key(0),
        )


def test_the_exact_test_reports_by_how_much_a_cached_read_differs():
    draft, target = markov_pair(3, 2, seed=2)
    loop = speculax.SpeculativeLoop(num_draft=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"target_model gives other logits") as caught:
        speculax.testing.loop_output_distribution(
            loop, cached(draft), Misbehaving(cached(target), "rounds"), [1, 0]
        )
    assert "by up to 1e-06" in str(caught.value)
    assert "a difference of rounding" in str(caught.value)


def test_a_draft_tree_must_be_a_draft_tree(without_runtime_type_checks):
    with pytest.raises(TypeError, match=r"draft_tree must be a speculax\.DraftTree"):
        speculax.SpeculativeLoop(
            draft_tree=(0, 0),  # type: ignore[arg-type]
            max_new_tokens=2,
            step=speculax.TreeStep(),
        )


@pytest.mark.parametrize("drafting", ["top-k", "independent"])
def test_a_draft_model_that_gives_nan_in_a_tree_loop_is_named(drafting):
    _, target = markov_pair(3, 1, seed=0)
    nan = MarkovModel(np.full((3, 3), np.nan), 1)
    loop = speculax.SpeculativeLoop(
        draft_tree=speculax.DraftTree((0, 0, 1), drafting=drafting),
        max_new_tokens=3,
        step=speculax.TreeStep(),
    )
    with pytest.raises(RuntimeError, match="draft_model gives logits whose draft row"):
        loop(nan, target, jnp.zeros((2, 2), jnp.int32), key=jax.random.key(0))


def test_cacheless_scores_chains_and_trees_and_refuses_other_reads():
    model = speculax.Cacheless(MarkovModel(np.log(np.arange(1, 10).reshape(3, 3)), 1))
    tokens, start = jnp.array([[1, 2, 0]]), jnp.ones(1, jnp.int32)
    cache = model.init_cache(1, 5).at[0, 0].set(2)
    chain = jnp.tril(jnp.ones((1, 3, 3), jnp.bool_))
    logits, written = model(tokens, 1 + jnp.arange(3)[None], chain, cache, start)
    assert written.tolist() == [[2, 1, 2, 0, 0]]
    # A token followed by two children, each at position 2, seeing the first.
    tree = jnp.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], jnp.bool_)
    tree_logits, written = model(tokens, jnp.array([[1, 2, 2]]), tree, cache, start)
    assert written.tolist() == [[2, 1, 2, 0, 0]]
    # Each read as its own path: the history, then the tokens it sees.
    table = np.asarray(jnp.asarray(model.model.logits))
    np.testing.assert_array_equal(tree_logits[0], table[[1, 2, 0]])
    np.testing.assert_array_equal(logits[0], table[[1, 2, 0]])
    # The third token at the position of a chain's: it sees two tokens, not three.
    with pytest.raises(Exception, match="Cacheless scores chains and trees only"):
        model(tokens, jnp.array([[1, 2, 3]]), tree, cache, start)
    # The first token seeing a later one.
    with pytest.raises(Exception, match="Cacheless scores chains and trees only"):
        model(tokens, jnp.array([[1, 2, 2]]), tree.at[0, 0, 2].set(True), cache, start)


@pytest.mark.parametrize(
    "shape",
    [
        {"num_draft": 2},
        {"draft_tree": speculax.DraftTree((0, 0, 1), drafting="independent")},
        {"draft_tree": speculax.DraftTree((0, 1), drafting="independent")},
    ],
    ids=["chain", "tree", "tree that is a chain"],
)
def test_the_loop_traces_a_cacheless_model_once_per_call(shape):
    """The loop knows before tracing which of its calls read chains and which read
    a tree's paths: a Cacheless model traces the model once per call, not once for
    each way it could score the new tokens (a chain round half as large again)."""
    traced = []

    def model(tokens, positions):
        traced.append(positions.shape)
        return jnp.zeros((*positions.shape, 3))

    step = {} if "num_draft" in shape else {"step": speculax.TreeStep()}
    loop = speculax.SpeculativeLoop(max_new_tokens=2, **shape, **step)
    prompt = jnp.zeros((2, 1), jnp.int32)
    jax.make_jaxpr(lambda p: loop(model, model, p, key=jax.random.key(0)))(prompt)
    # The prompt read three times: by the target for the vocabulary's size, then by
    # each model to fill its cache; then a round: the draft's first read, one read
    # per level below the first (per draft, for a chain), and the target's read.
    levels = shape["num_draft"] if "num_draft" in shape else shape["draft_tree"].depth
    assert len(traced) == 3 + 1 + (levels - 1) + 1


# Two children of the root with two children each; and the first with one.
TWO_BY_TWO = (0, 0, 1, 1, 2, 2)
SMALL = (0, 0, 1)


@functools.cache
def cached_tree_loop(
    drafting: str, parents: tuple[int, ...] = TWO_BY_TWO, max_new_tokens: int = 10
) -> speculax.SpeculativeLoop:
    siblings = {
        "without replacement": speculax.SiblingsWithoutReplacement(),
        "independent": speculax.IndependentSiblings(),
        "top-k": speculax.IndependentSiblings(),
    }[drafting]
    return speculax.SpeculativeLoop(
        draft_tree=speculax.DraftTree(parents, drafting=drafting),
        max_new_tokens=max_new_tokens,
        end_token=3,
        step=speculax.TraversalStep(siblings=siblings),
    )


@pytest.mark.parametrize(
    ("drafting", "which"),
    [
        ("without replacement", "both"),
        # The other drafting modes, with one model cached beside one not: the
        # extended tier.
        pytest.param("independent", "target", marks=pytest.mark.slow),
        pytest.param("top-k", "draft", marks=pytest.mark.slow),
    ],
)
def test_cached_tree_loop_gives_the_cacheless_tokens_bit_for_bit(drafting, which):
    # A context of two tokens: each node reads its parent, from the new tokens or,
    # for the first level, from the cache, and the path kept must be the history.
    out = cached_equals_cacheless(cached_tree_loop(drafting), which, seed=5)
    # Not vacuous: paths of both depths kept, and none.
    accepted = np.asarray(out["num_accepted"])
    assert {0, 1, 2} <= set(accepted[accepted >= 0].tolist())


# Siblings drawn without replacement, the drafting whose trees vary most; the other
# modes are enumerated without a cache in test_loop_trees.py.
@pytest.mark.slow
@pytest.mark.parametrize("drafting", ["without replacement"])
def test_cached_tree_loop_is_lossless_exactly(drafting):
    draft, target = markov_pair(3, 2, seed=6)
    loop = cached_tree_loop(drafting, SMALL, max_new_tokens=4)
    error = speculax.testing.loop_lossless_error(
        loop, cached(draft), cached(target), [1, 0]
    )
    assert error < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("faulty", ["draft", "target"])
def test_exact_test_refuses_a_faulty_cache_in_a_tree_loop(faulty):
    draft, target = markov_pair(3, 2, seed=6)
    models = {"draft": cached(draft), "target": cached(target)}
    models[faulty] = cached(models[faulty], "reads rejected drafts")
    loop = cached_tree_loop("independent", SMALL, max_new_tokens=3)
    # The calls that read the tree see the slots past the history first.
    match = f"{faulty}_model('s cache is read at or past| gives other logits)"
    with pytest.raises(ValueError, match=match):
        speculax.testing.loop_output_distribution(
            loop, models["draft"], models["target"], [1, 0]
        )


@pytest.mark.slow
def test_exact_test_refuses_a_loop_that_keeps_the_wrong_path(monkeypatch):
    # Without the accepted path's entries moved, the slots after the root hold the
    # tree's first nodes: the next round would read them as its history.
    import speculax._loop._tree_round as tree_round

    monkeypatch.setattr(tree_round, "keep_path", lambda caches, *args: caches)
    draft, target = markov_pair(3, 2, seed=6)
    # Two tokens: a program of its own, traced without the path kept.
    loop = cached_tree_loop("without replacement", SMALL, max_new_tokens=2)
    with pytest.raises(ValueError, match="target_model's cache after a step differs"):
        speculax.testing.loop_output_distribution(
            loop, cached(draft), cached(target), [1, 0]
        )
