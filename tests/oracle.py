"""A float64 NumPy reference for the step, straight from the specification
(`docs/concepts.md`), and its judge. Independent of the package on purpose: nothing
here imports it.

The subnormal rule: a probability, or a residual weight, whose magnitude is below the
smallest normal number of the arithmetic dtype (float32 unless the inputs are float64
under x64) counts as zero. Every function here applies it, with `smallest_normal`.
"""

import numpy as np


TIE_TOLERANCE = 1e-6
CDF_TOLERANCE = 1e-6
FLOAT32_SMALLEST_NORMAL = float(np.finfo(np.float32).smallest_normal)


def flushed(x, smallest_normal=FLOAT32_SMALLEST_NORMAL) -> np.ndarray:
    """`x` in float64 with every magnitude below `smallest_normal` set to zero."""
    x = np.asarray(x, np.float64)
    return np.where(np.abs(x) < smallest_normal, 0.0, x)


def acceptance_ratios(
    draft_tokens, draft_probs, target_probs, smallest_normal=FLOAT32_SMALLEST_NORMAL
) -> np.ndarray:
    """$p_i(x_i) / q_i(x_i)$ in float64; $q = 0$ gives inf (p > 0) or 0 (p = 0)."""
    tokens = np.asarray(draft_tokens)[..., None]
    num_draft = tokens.shape[1]
    p = np.take_along_axis(
        flushed(np.asarray(target_probs)[:, :num_draft], smallest_normal), tokens, -1
    )
    q = np.take_along_axis(flushed(draft_probs, smallest_normal), tokens, -1)
    p, q = p[..., 0], q[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(q > 0, p / np.where(q > 0, q, 1), np.where(p > 0, np.inf, 0.0))


def residual(
    row,
    num_accepted,
    draft_probs,
    target_probs,
    smallest_normal=FLOAT32_SMALLEST_NORMAL,
) -> np.ndarray:
    """The normalised residual distribution $r$ for one row, in float64."""
    inputs = {"draft_probs": draft_probs, "target_probs": target_probs}
    w = stopping_row_weights(inputs, row, num_accepted, smallest_normal)
    return w / w.sum()


def reference_step(
    draft_tokens,
    draft_probs,
    target_probs,
    accept_uniforms,
    sample_uniforms,
    smallest_normal=FLOAT32_SMALLEST_NORMAL,
) -> dict[str, np.ndarray]:
    """The step computed in float64, one row at a time."""
    draft_tokens = np.asarray(draft_tokens)
    batch, num_draft = draft_tokens.shape
    passed = np.asarray(accept_uniforms, np.float64) < acceptance_ratios(
        draft_tokens, draft_probs, target_probs, smallest_normal
    )
    tokens = np.full((batch, num_draft + 1), -1, np.int64)
    num_accepted = np.zeros(batch, np.int64)
    for row in range(batch):
        n = 0
        while n < num_draft and passed[row, n]:
            n += 1
        r = residual(row, n, draft_probs, target_probs, smallest_normal)
        cdf = np.cumsum(r)
        above = np.nonzero(cdf > float(np.asarray(sample_uniforms)[row]))[0]
        y = above[0] if above.size else np.nonzero(r > 0)[0][-1]
        num_accepted[row] = n
        tokens[row, :n] = draft_tokens[row, :n]
        tokens[row, n] = y
    return {"num_accepted": num_accepted, "tokens": tokens}


def judge(
    inputs: dict, output: dict, smallest_normal=FLOAT32_SMALLEST_NORMAL
) -> list[str]:
    """The judge of the specification: the problems with `output` (an empty list
    when it is right), under the subnormal rule of the arithmetic dtype whose smallest
    normal number is `smallest_normal`.

    A count is right when every test before it passes and the test at it fails (or
    n = G), where a test whose $u_i$ lies within 1e-6 * p/q of its ratio may go either
    way. A token is right when $r(y) > 0$ and the float64 normalised cumulative sums
    bracket $s$: $C(y - 1) \\le s + 10^{-6}$ and $C(y) > s - 10^{-6}$.
    """
    draft_tokens = np.asarray(inputs["draft_tokens"])
    batch, num_draft = draft_tokens.shape
    ratios = acceptance_ratios(
        draft_tokens, inputs["draft_probs"], inputs["target_probs"], smallest_normal
    )
    u = np.asarray(inputs["accept_uniforms"], np.float64)
    with np.errstate(invalid="ignore"):
        near_tie = np.abs(u - ratios) <= TIE_TOLERANCE * ratios
    passes = u < ratios
    num_accepted = np.asarray(output["num_accepted"])
    tokens = np.asarray(output["tokens"])
    problems = []
    if num_accepted.shape != (batch,) or tokens.shape != (batch, num_draft + 1):
        return [
            f"shapes {num_accepted.shape}, {tokens.shape} for B={batch} G={num_draft}"
        ]
    if num_accepted.dtype != np.int32 or tokens.dtype != np.int32:
        problems.append(f"dtypes {num_accepted.dtype}, {tokens.dtype} are not int32")
    for row in range(batch):
        n = int(num_accepted[row])
        if not 0 <= n <= num_draft:
            problems.append(f"row {row}: num_accepted {n} outside [0, {num_draft}]")
            continue
        before_ok = all(passes[row, i] or near_tie[row, i] for i in range(n))
        stop_ok = n == num_draft or not passes[row, n] or near_tie[row, n]
        if not (before_ok and stop_ok):
            problems.append(
                f"row {row}: num_accepted {n} contradicts the float64 tests"
            )
        expected_prefix = draft_tokens[row, :n].tolist()
        if tokens[row, :n].tolist() != expected_prefix:
            problems.append(f"row {row}: tokens do not start with the accepted drafts")
        if tokens[row, n + 1 :].tolist() != [-1] * (num_draft - n):
            problems.append(f"row {row}: tokens after y are not all -1")
        y = int(tokens[row, n])
        r = residual(
            row, n, inputs["draft_probs"], inputs["target_probs"], smallest_normal
        )
        if not 0 <= y < r.size or r[y] <= 0:
            problems.append(f"row {row}: token {y} has r(y) = 0 or lies outside [0, V)")
            continue
        cdf = np.cumsum(r)
        s = float(np.asarray(inputs["sample_uniforms"], np.float64)[row])
        below = cdf[y - 1] if y > 0 else 0.0
        if not (below <= s + CDF_TOLERANCE and cdf[y] > s - CDF_TOLERANCE):
            problems.append(
                f"row {row}: token {y} has C(y-1) = {below!r}, C(y) = {cdf[y]!r} "
                f"not bracketing s = {s!r}"
            )
    return problems


def possible_counts(inputs: dict, row: int, smallest_normal=FLOAT32_SMALLEST_NORMAL):
    """Every count $n$ the judge accepts for `row` (near-ties go either way)."""
    draft_tokens = np.asarray(inputs["draft_tokens"])
    num_draft = draft_tokens.shape[1]
    ratios = acceptance_ratios(
        draft_tokens, inputs["draft_probs"], inputs["target_probs"], smallest_normal
    )[row]
    u = np.asarray(inputs["accept_uniforms"], np.float64)[row]
    with np.errstate(invalid="ignore"):
        near_tie = np.abs(u - ratios) <= TIE_TOLERANCE * ratios
    may_pass = (u < ratios) | near_tie
    may_fail = ~(u < ratios) | near_tie
    return [
        n
        for n in range(num_draft + 1)
        if all(may_pass[:n]) and (n == num_draft or may_fail[n])
    ]


def stopping_row_weights(
    inputs: dict, row: int, n: int, smallest_normal=FLOAT32_SMALLEST_NORMAL
) -> np.ndarray:
    """The unnormalised float64 weights drawn from at `n`, after the fallback."""
    p = flushed(np.asarray(inputs["target_probs"])[row, n], smallest_normal)
    if n < np.asarray(inputs["draft_probs"]).shape[1]:
        q = flushed(np.asarray(inputs["draft_probs"])[row, n], smallest_normal)
        w = flushed(np.maximum(p - q, 0), smallest_normal)
        if w.sum() > 0:
            return w
    return p


def reference_probs_from_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """Temperature, top-k and top-p by sorting, in float64, for one set of
    parameters: the textbook definition `probs_from_logits` must agree with."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return np.eye(logits.shape[-1])[np.argmax(logits, -1)]
    logits = logits / temperature
    keep = np.ones(logits.shape, bool)
    if top_k is not None:
        kth = np.sort(logits, -1)[..., -top_k][..., None]
        keep &= logits >= kth
    probs = np.exp(logits - logits.max(-1, keepdims=True)) * keep
    probs /= probs.sum(-1, keepdims=True)
    if top_p is not None:
        for row in np.ndindex(probs.shape[:-1]):
            order = np.argsort(-probs[row], kind="stable")
            mass, needed = 0.0, []
            for token in order:
                if mass >= top_p:
                    break
                needed.append(probs[row][token])
                mass += probs[row][token]
            keep[row] &= probs[row] >= min(needed)
        probs = np.exp(logits - logits.max(-1, keepdims=True)) * keep
        probs /= probs.sum(-1, keepdims=True)
    return probs
