"""A float64 NumPy reference for the step, straight from SPEC section 1, and the judge
of SPEC section 2. Independent of the package on purpose: nothing here imports it.
"""

import numpy as np


TIE_TOLERANCE = 1e-6
CDF_TOLERANCE = 1e-6


def acceptance_ratios(draft_tokens, draft_probs, target_probs) -> np.ndarray:
    """$p_i(x_i) / q_i(x_i)$ in float64; $q = 0$ gives inf (p > 0) or 0 (p = 0)."""
    tokens = np.asarray(draft_tokens)[..., None]
    num_draft = tokens.shape[1]
    p = np.take_along_axis(
        np.asarray(target_probs, np.float64)[:, :num_draft], tokens, -1
    )
    q = np.take_along_axis(np.asarray(draft_probs, np.float64), tokens, -1)
    p, q = p[..., 0], q[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(q > 0, p / np.where(q > 0, q, 1), np.where(p > 0, np.inf, 0.0))


def residual(row, num_accepted, draft_probs, target_probs) -> np.ndarray:
    """The normalised distribution $r$ of SPEC 1.3 for one row, in float64."""
    p = np.asarray(target_probs, np.float64)[row, num_accepted]
    num_draft = np.asarray(draft_probs).shape[1]
    if num_accepted < num_draft:
        w = np.maximum(p - np.asarray(draft_probs, np.float64)[row, num_accepted], 0)
    else:
        w = p
    if w.sum() == 0:
        w = p
    return w / w.sum()


def reference_step(
    draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms
) -> dict[str, np.ndarray]:
    """SPEC section 1 computed in float64, one row at a time."""
    draft_tokens = np.asarray(draft_tokens)
    batch, num_draft = draft_tokens.shape
    passed = np.asarray(accept_uniforms, np.float64) < acceptance_ratios(
        draft_tokens, draft_probs, target_probs
    )
    tokens = np.full((batch, num_draft + 1), -1, np.int64)
    num_accepted = np.zeros(batch, np.int64)
    for row in range(batch):
        n = 0
        while n < num_draft and passed[row, n]:
            n += 1
        r = residual(row, n, draft_probs, target_probs)
        cdf = np.cumsum(r)
        above = np.nonzero(cdf > float(np.asarray(sample_uniforms)[row]))[0]
        y = above[0] if above.size else np.nonzero(r > 0)[0][-1]
        num_accepted[row] = n
        tokens[row, :n] = draft_tokens[row, :n]
        tokens[row, n] = y
    return {"num_accepted": num_accepted, "tokens": tokens}


def judge(inputs: dict, output: dict) -> list[str]:
    """SPEC 2's oracle: the problems with `output` (an empty list when it is right).

    A count is right when every test before it passes and the test at it fails (or
    n = G), where a test whose $u_i$ lies within 1e-6 * p/q of its ratio may go either
    way. A token is right when $r(y) > 0$ and the float64 normalised cumulative sums
    bracket $s$: $C(y - 1) \\le s + 10^{-6}$ and $C(y) > s - 10^{-6}$.
    """
    draft_tokens = np.asarray(inputs["draft_tokens"])
    batch, num_draft = draft_tokens.shape
    ratios = acceptance_ratios(
        draft_tokens, inputs["draft_probs"], inputs["target_probs"]
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
        r = residual(row, n, inputs["draft_probs"], inputs["target_probs"])
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
