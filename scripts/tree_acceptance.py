"""Expected accepted tokens per step of the tree step's rules against the target-only
rule, and of trees against chains: exactly, by enumeration on small models, and by
sampling on realistic distributions. Prints the two Markdown tables of
`docs/trees.md`.

    python scripts/tree_acceptance.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import speculax
import speculax.testing
from speculax._cli._bench import Size, eagle_tree, make_tree_inputs


VOCAB = 4
SHAPES = {
    "chain of 6": [0, 1, 2, 3, 4, 5],
    "depth 2 x width 2 (6 nodes)": [0, 0, 1, 1, 2, 2],
    "width 3 x depth 1": [0, 0, 0],
}


def language_model(seed: int):
    @functools.cache
    def model(prefix):
        rng = np.random.default_rng([seed, len(prefix), *prefix])
        weights = rng.gamma(1.0, size=VOCAB) + 0.05
        return weights / weights.sum()

    return model


def expected_accepted(step, parents, drafting, target_only=False) -> float:
    distribution = speculax.testing.tree_output_distribution(
        step,
        parents,
        language_model(0),
        language_model(1),
        VOCAB,
        drafting=drafting,
        target_only=target_only,
    )
    return sum(p * (len(tokens) - 1) for tokens, p in distribution.items())


def enumeration_table() -> str:
    lines = [
        "| tree | independent drafts, with q | independent drafts, target-only "
        "| drafts without replacement, with q | without replacement, target-only |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, parents in SHAPES.items():
        cells = [
            expected_accepted(speculax.TreeStep(), parents, "independent"),
            expected_accepted(speculax.TreeStep(), parents, "independent", True),
            expected_accepted(
                speculax.TreeStep(speculax.SiblingsWithoutReplacement()),
                parents,
                "without replacement",
            ),
            expected_accepted(
                speculax.TreeStep(), parents, "without replacement", True
            ),
        ]
        lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def sampled_table(batch: int = 512, vocab: int = 2048) -> str:
    lines = [
        "| draft | nodes | with q | target-only |",
        "|---|---:|---:|---:|",
    ]
    for name, parents in {
        "EAGLE-2-like tree, depth 6": eagle_tree(60),
        "chain of 6": list(range(6)),
        "chain of 60": list(range(60)),
    }.items():
        size = Size(batch, len(parents), vocab, variant="tree")
        inputs = list(make_tree_inputs(size, seed=1))
        inputs[0] = jnp.tile(jnp.asarray(parents, jnp.int32), (batch, 1))
        # Each node's token drawn from its parent's draft row, in this shape.
        parent_probs = jnp.take_along_axis(inputs[2], inputs[0][:, :, None], axis=1)
        inputs[1] = jax.random.categorical(
            jax.random.key(2), jnp.log(parent_probs), axis=-1
        ).astype(jnp.int32)
        step = jax.jit(speculax.TreeStep())
        with_q = float(jnp.mean(step(*inputs)["num_accepted"]))
        target_only = float(
            jnp.mean(step(inputs[0], inputs[1], None, *inputs[3:])["num_accepted"])
        )
        lines.append(f"| {name} | {len(parents)} | {with_q:.2f} | {target_only:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"Exact expected accepted tokens, V = {VOCAB}, random models\n")
    print(enumeration_table())
    print("\nSampled mean accepted tokens, 512 trees, V = 2048, realistic rows\n")
    print(sampled_table())
