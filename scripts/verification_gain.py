"""Expected accepted tokens per step of block verification against token-by-token
verification on chains, and of traversal verification against recursive rejection
sampling (`TreeStep`) on trees: exactly, by enumeration on small models, and by
sampling on realistic sizes. Prints four Markdown tables, for
`docs/keeping_more.md`, and draws docs/images/verification_gain.svg.

Each draft distribution is a perturbed copy of its target, $q = \\mathrm{softmax}(\\log
p + \\sigma \\varepsilon)$ with $\\varepsilon$ standard normal, and the drafts are
sampled from $q$. The sampled tables feed both steps the same rows, draft tokens and
uniforms, and report the paired difference; $\\pm$ is one standard error. About a
minute and a half on two CPU cores (needs matplotlib, in the `docs` extra):

    python scripts/verification_gain.py [--vocab 4096] [--tree-vocab 1024]
        [--rows 2000] [--tree-rows 1000] [--draws 16]
        [--output docs/images/verification_gain.svg]
"""

import argparse
import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np


matplotlib.use("Agg")
import matplotlib.pyplot as plt

import speculax
import speculax.testing
from speculax._cli._bench import eagle_tree


# Vector output, sharp at any zoom; text stays text, so the file stays small (plain
# text: mathtext would write every character apart).
matplotlib.rcParams["svg.fonttype"] = "none"
SIGMA = "\N{GREEK SMALL LETTER SIGMA}"

DEFAULT_OUTPUT = (
    Path(__file__).resolve().parent.parent / "docs/images/verification_gain.svg"
)
SIGMAS = (0.5, 1.0, 2.0)
TEMPERATURES = (0.6, 1.0, 1.4)
CHAIN_SIZES = ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4))  # (V, G)
CHAIN_SEEDS = 8
TREE_VOCAB = 4
TREE_SIGMA = 1.0
TREE_SEEDS = 4
TREES = ([0, 1, 2], [0, 0, 0], [0, 1, -1, 0, 2], [0, 0, 1, 1, 2, 2])
DRAFTINGS = {
    "independent": speculax.IndependentSiblings(),
    "without replacement": speculax.SiblingsWithoutReplacement(),
}
# Logits of the sampled rows: standard normal times this, before the temperature.
LOGIT_SCALE = 3.0
SAMPLED_SIGMA = 1.0
CHAIN_DRAFT = 5
TREE_NODES = 60
CHUNK = 250


def perturbed(p: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """$\\mathrm{softmax}(\\log p + \\sigma \\varepsilon)$ along the last axis."""
    logits = np.log(p) + sigma * rng.standard_normal(p.shape)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def gain(base: float, new: float) -> str:
    """The relative gain of `new` over `base`, in percent."""
    return f"{100 * (new - base) / base:+.1f}%"


def chain_exact(vocab: int, num_draft: int, sigma: float) -> tuple[float, float]:
    """Exact expected accepted tokens of the token-by-token and block steps, averaged
    over `CHAIN_SEEDS` rows: targets uniform on the simplex, drafts perturbed."""
    steps = (speculax.SpeculativeStep(), speculax.block_step())
    totals = np.zeros(2)
    for seed in range(CHAIN_SEEDS):
        rng = np.random.default_rng([seed, vocab, num_draft])
        p = rng.dirichlet(np.ones(vocab), size=num_draft + 1)
        q = perturbed(p[:num_draft], sigma, rng)
        for i, step in enumerate(steps):
            probs = speculax.testing.output_distribution(step, q, p).num_accepted_probs
            totals[i] += probs @ np.arange(num_draft + 1)
    return tuple(totals / CHAIN_SEEDS)


def chain_exact_table() -> tuple[str, dict]:
    """Table 1, and its numbers by `(V, G, sigma)` for the plot."""
    lines = [
        "| $V$ | $G$ | $\\sigma$ | token by token | block | gain |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    results = {}
    for vocab, num_draft in CHAIN_SIZES:
        for sigma in SIGMAS:
            token, block = chain_exact(vocab, num_draft, sigma)
            results[vocab, num_draft, sigma] = (token, block)
            lines.append(
                f"| {vocab} | {num_draft} | {sigma} | {token:.4f} | {block:.4f} "
                f"| {gain(token, block)} |"
            )
    return "\n".join(lines), results


def tree_models(seed: int):
    """A target model over `TREE_VOCAB` tokens, a distribution for every prefix
    without zeros, and a draft model that perturbs it by `TREE_SIGMA`."""

    @functools.cache
    def target(prefix: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([seed, len(prefix), *prefix])
        weights = rng.gamma(1.0, size=TREE_VOCAB) + 0.05
        return weights / weights.sum()

    @functools.cache
    def draft(prefix: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([seed, 1, len(prefix), *prefix])
        return perturbed(target(prefix), TREE_SIGMA, rng)

    return target, draft


def tree_exact(parents: list[int], drafting: str) -> tuple[float, float]:
    """Exact expected accepted tokens of `TreeStep` and `TraversalStep` with the
    sibling rule of `drafting`, averaged over `TREE_SEEDS` pairs of models."""
    siblings = DRAFTINGS[drafting]
    steps = (speculax.TreeStep(siblings), speculax.TraversalStep(siblings))
    totals = np.zeros(2)
    for seed in range(TREE_SEEDS):
        target, draft = tree_models(seed)
        for i, step in enumerate(steps):
            distribution = speculax.testing.tree_output_distribution(
                step, parents, target, draft, TREE_VOCAB, drafting=drafting
            )
            totals[i] += sum(
                p * (len(tokens) - 1) for tokens, p in distribution.items()
            )
    return tuple(totals / TREE_SEEDS)


def tree_exact_table() -> str:
    """Table 2."""
    lines = [
        "| parents | drafting | recursive rejection sampling | traversal | gain |",
        "|:---|:---|---:|---:|---:|",
    ]
    for parents in TREES:
        for drafting in DRAFTINGS:
            rrs, traversal = tree_exact(parents, drafting)
            lines.append(
                f"| `{parents}` | {drafting} | {rrs:.4f} | {traversal:.4f} "
                f"| {gain(rrs, traversal)} |"
            )
    return "\n".join(lines)


def inverse_cdf(key: jax.Array, cdf: jax.Array) -> jax.Array:
    """A token drawn from each row of unnormalised cumulative sums `cdf`."""
    u = jax.random.uniform(key, (*cdf.shape[:-1], 1)) * cdf[..., -1:]
    return jnp.minimum(jnp.sum(cdf < u, axis=-1), cdf.shape[-1] - 1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("draws",))
def chain_draws(
    key: jax.Array,
    logits: jax.Array,
    draft_logits: jax.Array,
    temperature: float,
    draws: int,
) -> jax.Array:
    """`num_accepted` of the token-by-token and block steps, shape `(2, draws, B)`,
    on the rows at `temperature`, for `draws` independent draft tokens and uniforms
    per row, the same for both steps. The last draft row is not used."""
    p = jax.nn.softmax(logits / temperature, axis=-1)
    q = jax.nn.softmax(draft_logits[:, :-1] / temperature, axis=-1)
    cdf = jnp.cumsum(q, axis=-1)
    batch, num_draft = q.shape[:2]

    def draw(key):
        keys = jax.random.split(key, 3)
        tokens = inverse_cdf(keys[0], cdf)
        u = jax.random.uniform(keys[1], (batch, num_draft))
        s = jax.random.uniform(keys[2], (batch,))
        return jnp.stack(
            [
                speculax.SpeculativeStep()(tokens, q, p, u, s)["num_accepted"],
                speculax.block_step()(tokens, q, p, u, s)["num_accepted"],
            ]
        )

    return jnp.moveaxis(jax.lax.map(draw, jax.random.split(key, draws)), 0, 1)


@functools.partial(jax.jit, static_argnames=("draws", "max_depth"))
def tree_draws(
    key: jax.Array,
    logits: jax.Array,
    draft_logits: jax.Array,
    temperature: float,
    draws: int,
    parents: jax.Array,
    max_depth: int,
) -> jax.Array:
    """As `chain_draws`, for `TreeStep` and `TraversalStep` on trees of the shape
    `parents`, each node's children drawn independently from its draft row."""
    p = jax.nn.softmax(logits / temperature, axis=-1)
    q = jax.nn.softmax(draft_logits / temperature, axis=-1)
    parent_cdf = jnp.cumsum(q, axis=-1)[:, parents]
    batch, num_nodes = parent_cdf.shape[:2]
    tree = jnp.broadcast_to(parents, (batch, num_nodes))
    steps = (speculax.TreeStep(), speculax.TraversalStep(max_depth=max_depth))

    def draw(key):
        keys = jax.random.split(key, 3)
        tokens = inverse_cdf(keys[0], parent_cdf)
        u = jax.random.uniform(keys[1], (batch, num_nodes))
        s = jax.random.uniform(keys[2], (batch,))
        return jnp.stack(
            [step(tree, tokens, q, p, u, s)["num_accepted"] for step in steps]
        )

    return jnp.moveaxis(jax.lax.map(draw, jax.random.split(key, draws)), 0, 1)


@functools.partial(jax.jit, static_argnames=("shape",))
def random_logits(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Target logits, normal times `LOGIT_SCALE`, and draft logits that perturb them
    by `SAMPLED_SIGMA`."""
    keys = jax.random.split(key)
    logits = LOGIT_SCALE * jax.random.normal(keys[0], shape)
    return logits, logits + SAMPLED_SIGMA * jax.random.normal(keys[1], shape)


def sampled(
    run: Callable, rows: int, shape: tuple[int, ...], draws: int, seed: int
) -> dict:
    """Runs `run(key, logits, draft_logits, temperature, draws)` on `rows` rows of
    the given per-row `shape`, in chunks, at each temperature (the same rows and keys
    at every temperature); returns by temperature the means of the two steps and of
    their difference, with standard errors over the rows (each row averaged over its
    draws)."""
    per_row: dict[float, list[np.ndarray]] = {t: [] for t in TEMPERATURES}
    for chunk in range(0, rows, CHUNK):
        key = jax.random.fold_in(jax.random.key(seed), chunk)
        batch = min(CHUNK, rows - chunk)
        logits, draft_logits = random_logits(key, (batch, *shape))
        for t in TEMPERATURES:
            accepted = run(jax.random.fold_in(key, 1), logits, draft_logits, t, draws)
            per_row[t].append(np.asarray(accepted).mean(axis=1))
    results = {}
    for t, chunks in per_row.items():
        base, new = np.concatenate(chunks, axis=1)
        results[t] = [
            (float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size)))
            for x in (base, new, new - base)
        ]
    return results


def sampled_table(results: dict, base: str, new: str) -> str:
    """Table 3 or 4, from the output of `sampled`."""
    lines = [
        f"| $T$ | {base} | {new} | difference | gain |",
        "|---:|---:|---:|---:|---:|",
    ]
    for t, cells in results.items():
        text = " | ".join(f"{mean:.3f} ± {error:.3f}" for mean, error in cells)
        lines.append(f"| {t} | {text} | {gain(cells[0][0], cells[1][0])} |")
    return "\n".join(lines)


def tree_depth(parents: list[int]) -> int:
    """The depth of the deepest node."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    return max(depth)


def plot(
    exact: dict, chains: dict, trees: dict, vocab: int, tree_vocab: int, output: Path
) -> None:
    """Left: exact chains against sigma; right: sampled chains and trees against
    the temperature."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    colors = {2: "tab:blue", 3: "tab:orange", 4: "tab:green"}
    for num_draft, color in colors.items():
        token, block = zip(*(exact[8, num_draft, s] for s in SIGMAS), strict=True)
        label = f"G = {num_draft}"
        left.plot(SIGMAS, token, "o--", color=color, label=f"{label}, token by token")
        left.plot(SIGMAS, block, "o-", color=color, label=f"{label}, block")
    left.set_xlabel(f"draft perturbation {SIGMA}")
    left.set_title("exact, chains, V = 8", fontsize=10)
    curves = (
        (chains, 0, "o--", "tab:blue", f"chain G = {CHAIN_DRAFT}, token by token"),
        (chains, 1, "o-", "tab:blue", f"chain G = {CHAIN_DRAFT}, block"),
        (trees, 0, "s--", "tab:red", f"EAGLE-2 tree N = {TREE_NODES}, RRS"),
        (trees, 1, "s-", "tab:red", f"EAGLE-2 tree N = {TREE_NODES}, traversal"),
    )
    for results, index, style, color, label in curves:
        means, errors = zip(*(results[t][index] for t in TEMPERATURES), strict=True)
        right.errorbar(
            TEMPERATURES, means, errors, fmt=style, color=color, label=label, capsize=3
        )
    right.set_xlabel("temperature T")
    right.set_title(
        f"sampled, V = {vocab} (chain), {tree_vocab} (tree), {SIGMA} = {SAMPLED_SIGMA}",
        fontsize=10,
    )
    for axis in (left, right):
        axis.set_ylabel("expected accepted tokens")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7, frameon=False, handlelength=3.5)
        axis.spines[["top", "right"]].set_visible(False)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=4096, help="V of sampled chains")
    parser.add_argument("--tree-vocab", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2000, help="sampled chain rows")
    parser.add_argument("--tree-rows", type=int, default=1000)
    parser.add_argument("--draws", type=int, default=16, help="drafts per row")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    chain_text, exact = chain_exact_table()
    tree_text = tree_exact_table()
    chains = sampled(
        chain_draws, args.rows, (CHAIN_DRAFT + 1, args.vocab), args.draws, seed=0
    )
    parents = eagle_tree(TREE_NODES)
    depth = tree_depth(parents)
    trees = sampled(
        functools.partial(
            tree_draws, parents=jnp.asarray(parents, jnp.int32), max_depth=depth
        ),
        args.tree_rows,
        (TREE_NODES + 1, args.tree_vocab),
        args.draws,
        seed=1,
    )
    plot(exact, chains, trees, args.vocab, args.tree_vocab, args.output)

    sigma = "$\\sigma$"
    print(
        f"Exact expected accepted tokens per step, chains, mean of {CHAIN_SEEDS} "
        f"random rows: targets uniform on the simplex, drafts perturbed by {sigma}\n"
    )
    print(chain_text)
    print(
        f"\nExact expected accepted tokens per step, trees, $V$ = {TREE_VOCAB}, mean "
        f"of {TREE_SEEDS} random models, drafts perturbed by {sigma} = {TREE_SIGMA}\n"
    )
    print(tree_text)
    print(
        f"\nSampled mean accepted tokens, chains of $G$ = {CHAIN_DRAFT}, "
        f"$V$ = {args.vocab}, {args.rows} rows x {args.draws} drafts, "
        f"{sigma} = {SAMPLED_SIGMA}\n"
    )
    print(sampled_table(chains, "token by token", "block"))
    print(
        f"\nSampled mean accepted tokens, EAGLE-2-like tree of {TREE_NODES} nodes "
        f"(depth {depth}), independent drafts, $V$ = {args.tree_vocab}, "
        f"{args.tree_rows} trees x {args.draws} drafts, {sigma} = {SAMPLED_SIGMA}\n"
    )
    print(sampled_table(trees, "recursive rejection sampling", "traversal"))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
