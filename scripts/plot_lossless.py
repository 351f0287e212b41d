"""Draws docs/images/lossless.svg: the step's output matches the target, not the draft.

Runs the real [`speculax.SpeculativeStep`][] on many independent rows that share one
set of distributions $q_i$, $p_i$, with every draft token drawn from its $q_i$ and
fresh uniforms per row, then plots the empirical distribution of output token $k$
(over the rows with $n \\ge k$) beside $p_k$ and $q_k$.

Usage (a docs-time tool; needs the `docs` extra for matplotlib):

    python scripts/plot_lossless.py [--output docs/images/lossless.svg]
"""

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import speculax


# Vector output, sharp at any zoom; text stays text, so the file stays small.
matplotlib.rcParams["svg.fonttype"] = "none"

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs/images/lossless.svg"


def simulate(
    num_rows: int, vocab: int, num_draft: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Runs the step on `num_rows` rows; returns `(q, p, tokens, num_accepted)`."""
    keys = jax.random.split(jax.random.key(seed), 5)
    target_probs = jax.nn.softmax(
        1.5 * jax.random.normal(keys[0], (num_draft + 1, vocab)), axis=-1
    )
    draft_probs = jax.nn.softmax(
        1.5 * jax.random.normal(keys[1], (num_draft, vocab)), axis=-1
    )
    # Every row draws its own draft tokens x_i ~ q_i and its own uniforms.
    draft_tokens = jax.random.categorical(
        keys[2], jnp.log(draft_probs), axis=-1, shape=(num_rows, num_draft)
    )
    step = jax.jit(speculax.SpeculativeStep())
    out = step(
        draft_tokens,
        jnp.broadcast_to(draft_probs, (num_rows, num_draft, vocab)),
        jnp.broadcast_to(target_probs, (num_rows, num_draft + 1, vocab)),
        jax.random.uniform(keys[3], (num_rows, num_draft)),
        jax.random.uniform(keys[4], (num_rows,)),
    )
    return (
        np.asarray(draft_probs),
        np.asarray(target_probs),
        np.asarray(out["tokens"]),
        np.asarray(out["num_accepted"]),
    )


def plot(
    q: np.ndarray,
    p: np.ndarray,
    tokens: np.ndarray,
    num_accepted: np.ndarray,
    position: int,
    output: Path,
) -> float:
    """Plots position `position`; returns the total variation distance to $p_k$."""
    vocab = p.shape[-1]
    reached = num_accepted >= position
    counts = np.bincount(tokens[reached, position], minlength=vocab)
    empirical = counts / counts.sum()
    total_variation = 0.5 * float(np.abs(empirical - p[position]).sum())

    fig, ax = plt.subplots(figsize=(7.0, 3.2))
    v = np.arange(vocab)
    width = 0.4
    ax.bar(
        v - width / 2,
        p[position],
        width,
        label=f"target $p_{position}$",
        color="#4c72b0",
    )
    ax.bar(
        v + width / 2,
        empirical,
        width,
        label=f"emitted token {position} (given $n \\geq {position}$)",
        color="#f0a30a",
    )
    ax.step(
        v,
        q[position],
        where="mid",
        color="#555555",
        linestyle="--",
        linewidth=1.0,
        label=f"draft $q_{position}$",
    )
    ax.set_xticks(v)
    ax.set_xlabel("token")
    ax.set_ylabel("probability")
    ax.set_title(
        f"{int(reached.sum()):,} rows reach position {position}; "
        f"total variation to $p_{position}$ = {total_variation:.4f}",
        fontsize=10,
    )
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return total_variation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--vocab", type=int, default=12)
    parser.add_argument("--draft", type=int, default=3, help="G, the draft length")
    parser.add_argument("--position", type=int, default=1, help="k, in [0, G]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 0 <= args.position <= args.draft:
        parser.error("--position must lie in [0, --draft]")

    q, p, tokens, num_accepted = simulate(args.rows, args.vocab, args.draft, args.seed)
    total_variation = plot(q, p, tokens, num_accepted, args.position, args.output)
    print(f"wrote {args.output} (total variation {total_variation:.4f})")


if __name__ == "__main__":
    main()
