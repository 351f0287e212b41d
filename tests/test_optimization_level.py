"""The suite compiles with LLVM's optimizations off (`tests/conftest.py`), which
takes about a third off its compile time; users compile with them on. LLVM keeps
IEEE arithmetic at every level (XLA asks for no fast math), and XLA's own passes,
which choose the operations and their order, are the same at both: so every program
gives the same bits either way, and what the suite proves of its programs holds for
the users'. Checked here on the programs of the most arithmetic: verification from
logits under per-row parameters, and a loop around the chain step. Rows one at a
time, as on the CPU: on accelerators the level of the CPU's LLVM plays no part.
"""

import jax
import jax.numpy as jnp
import numpy as np

import speculax


# What a user's compilation runs: XLA's defaults for the CPU.
USERS_LEVEL = {
    "xla_backend_optimization_level": 3,
    "xla_llvm_disable_expensive_passes": False,
}


def assert_same_bits_at_both_levels(function, *args) -> None:
    """Compiles `function` for `args` as the suite does and as users do, and
    asserts that the two programs give the same outputs, bit for bit."""
    lowered = jax.jit(function).lower(*args)
    suite = jax.tree.leaves(lowered.compile()(*args))
    users = jax.tree.leaves(lowered.compile(compiler_options=USERS_LEVEL)(*args))
    assert len(suite) == len(users) > 0
    for ours, theirs in zip(suite, users, strict=True):
        np.testing.assert_array_equal(
            np.atleast_1d(ours).view(np.uint8), np.atleast_1d(theirs).view(np.uint8)
        )


def test_the_suite_compiles_without_llvm_optimizations():
    # Not vacuous: the comparisons below are between two levels.
    assert jax.config.values["jax_disable_most_optimizations"]


def test_logits_give_the_same_bits_at_both_levels():
    batch, num_draft, vocab = 6, 3, 300
    rng = np.random.default_rng(0)
    draft_logits = jnp.asarray(3 * rng.standard_normal((batch, num_draft, vocab)))
    target_logits = jnp.asarray(3 * rng.standard_normal((batch, num_draft + 1, vocab)))
    draft_tokens = jnp.asarray(rng.integers(0, vocab, (batch, num_draft)))
    # A mixed batch, traced: greedy rows, top-k, top-p, both and neither.
    temperature = jnp.array([0.0, 0.7, 1.0, 1.3, 0.9, 1.0])
    top_k = jnp.array([0, 5, 0, 40, 0, 300])
    top_p = jnp.array([1.0, 1.0, 0.8, 0.5, 0.95, 1.0], jnp.float32)

    def verify(draft_logits, target_logits, temperature, top_k, top_p):
        parameters = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        probs = speculax.probs_from_logits(target_logits, **parameters)
        out = speculax.LogitsStep()(
            draft_tokens,
            draft_logits,
            target_logits,
            key=jax.random.key(1),
            **parameters,
        )
        return probs, out

    assert_same_bits_at_both_levels(
        verify, draft_logits, target_logits, temperature, top_k, top_p
    )


def test_a_loop_gives_the_same_bits_at_both_levels():
    rng = np.random.default_rng(3)
    tables = jnp.asarray(2 * rng.standard_normal((2, 5, 5)), jnp.float32)

    def bigram(table):
        def model(tokens, positions):
            return table[jnp.take_along_axis(tokens, positions, axis=1)]

        return model

    loop = speculax.SpeculativeLoop(num_draft=3, max_new_tokens=8, end_token=4)

    def generate(tables, prompt, key):
        return loop(bigram(tables[0]), bigram(tables[1]), prompt, key=key)

    prompt = jnp.asarray(rng.integers(0, 5, (16, 2)), jnp.int32)
    assert_same_bits_at_both_levels(generate, tables, prompt, jax.random.key(4))
