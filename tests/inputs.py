"""Random step inputs for the tests: realistic, adversarial and degenerate."""

import numpy as np


STYLES = ("peaked", "flat", "sparse", "equal", "onehot")
UNIFORMS = ("random", "ties", "edges")
LARGEST_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


def random_inputs(
    seed: int,
    batch: int,
    num_draft: int,
    vocab: int,
    style: str = "peaked",
    uniforms: str = "random",
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Step inputs of the given sizes, with probability rows in one of `STYLES` and
    uniforms in one of `UNIFORMS` (`ties` puts some $u_i$ exactly on their ratio,
    `edges` uses 0 and the largest float32 below 1).
    """
    rng = np.random.default_rng(seed)

    def distributions(rows: int) -> np.ndarray:
        shape = (batch, rows, vocab)
        if style == "flat":
            weights = np.ones(shape) + 1e-3 * rng.random(shape)
        elif style == "sparse":
            weights = rng.random(shape) * (rng.random(shape) < 0.3)
            weights[..., rng.integers(vocab)] += 0.1
        elif style == "onehot":
            weights = np.zeros(shape)
            np.put_along_axis(
                weights, rng.integers(0, vocab, (batch, rows, 1)), 1.0, -1
            )
        else:
            weights = np.exp(3 * rng.standard_normal(shape))
        return (weights / weights.sum(-1, keepdims=True)).astype(dtype)

    target_probs = distributions(num_draft + 1)
    draft_probs = distributions(num_draft)
    if style == "equal" and num_draft:
        # Equal rows make the residual max(p - q, 0) vanish up to rounding, which is
        # where the p_n fallback and the zero-mass rules are exercised.
        same = rng.random((batch, num_draft)) < 0.5
        draft_probs[same] = target_probs[:, :num_draft][same]
    draft_tokens = np.zeros((batch, num_draft), np.int32)
    for index in np.ndindex(batch, num_draft):
        q = draft_probs[index].astype(np.float64)
        if rng.random() < 0.8 and q.sum() > 0:
            draft_tokens[index] = rng.choice(vocab, p=q / q.sum())
        else:
            draft_tokens[index] = rng.integers(vocab)

    accept_uniforms = rng.random((batch, num_draft)).astype(dtype)
    sample_uniforms = rng.random(batch).astype(dtype)
    if uniforms == "ties" and num_draft:
        tokens = draft_tokens[..., None]
        p = np.take_along_axis(target_probs[:, :num_draft], tokens, -1)[..., 0]
        q = np.take_along_axis(draft_probs, tokens, -1)[..., 0]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = (p.astype(np.float64) / q).astype(dtype)
        on_tie = (rng.random(accept_uniforms.shape) < 0.5) & (ratio < 1)
        accept_uniforms = np.where(on_tie, ratio, accept_uniforms).astype(dtype)
    elif uniforms == "edges":
        accept_uniforms = rng.choice([0.0, LARGEST_BELOW_ONE], accept_uniforms.shape)
        sample_uniforms = rng.choice([0.0, LARGEST_BELOW_ONE], sample_uniforms.shape)
        accept_uniforms = accept_uniforms.astype(dtype)
        sample_uniforms = sample_uniforms.astype(dtype)
    return {
        "draft_tokens": draft_tokens,
        "draft_probs": draft_probs,
        "target_probs": target_probs,
        "accept_uniforms": accept_uniforms,
        "sample_uniforms": sample_uniforms,
    }


def random_row(
    seed: int, vocab: int, num_draft: int, zeros: str
) -> tuple[np.ndarray, np.ndarray]:
    """Random normalised q (G, V) and p (G + 1, V); `zeros` names which of them get
    exact zeros, so that both corners of the acceptance test (q_i(x) = 0 and
    p_i(x) = 0) are reached.
    """
    rng = np.random.default_rng([seed, vocab, num_draft])
    q = rng.dirichlet(np.ones(vocab), size=num_draft)
    p = rng.dirichlet(np.ones(vocab), size=num_draft + 1)
    for name, x in (("draft", q), ("target", p)):
        if zeros in (name, "both") and vocab > 1:
            x *= rng.random(x.shape) < 0.5
            # Keep one positive entry per row, so that the row is a distribution.
            x[np.arange(len(x)), rng.integers(vocab, size=len(x))] += rng.random(len(x))
            x /= x.sum(axis=-1, keepdims=True)
    return q, p


def close_drafts(
    seed: int,
    batch: int,
    num_draft: int,
    vocab: int,
    sigma: float = 0.5,
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """`random_inputs` whose drafts are a perturbed copy of the target, each $q_i$
    proportional to $p_i e^{\\sigma z}$ with $z$ standard normal, and the draft
    tokens sampled from them: long blocks are kept, and every kind of block seen."""
    inputs = random_inputs(seed, batch, num_draft, vocab)
    rng = np.random.default_rng(seed)
    target = inputs["target_probs"].astype(np.float64)
    draft = target[:, :num_draft] * np.exp(
        sigma * rng.standard_normal(target[:, :num_draft].shape)
    )
    draft /= draft.sum(-1, keepdims=True)
    cumulative = np.cumsum(draft, axis=-1)
    uniform = rng.random((batch, num_draft, 1))
    tokens = np.minimum((cumulative < uniform).sum(-1), vocab - 1)
    inputs.update(draft_tokens=tokens, draft_probs=draft, target_probs=target)
    for name in ("draft_probs", "target_probs", "accept_uniforms", "sample_uniforms"):
        inputs[name] = inputs[name].astype(dtype)
    return inputs


# Every integer dtype, for the tests that integers are read by value in each.
ALL_INTEGER_DTYPES = [
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
]
