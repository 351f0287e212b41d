"""The command line: `speculax demo` (with `--loop` too) and `speculax run`."""

import json
import subprocess
import sys
import warnings

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import pytest

from speculax._cli._command import INPUT_NAMES
from test_examples import WORKED_EXAMPLES


def _main(argv, capsys):
    from speculax._cli._command import main

    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("inputs, expected", WORKED_EXAMPLES)
def test_run_prints_exactly_the_expected_json(inputs, expected, tmp_path, capsys):
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(inputs))
    status, out, err = _main(["run", str(path)], capsys)
    assert status == 0, err
    assert out == json.dumps(expected, separators=(",", ":")) + "\n"


def test_run_reads_standard_input_through_the_installed_module():
    inputs, expected = WORKED_EXAMPLES[0]
    result = subprocess.run(
        [sys.executable, "-m", "speculax", "run"],
        input=json.dumps(inputs),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '{"num_accepted":[1],"tokens":[[3,3,-1]]}'
    assert json.loads(result.stdout) == expected


def _with(**changes):
    inputs = dict(WORKED_EXAMPLES[0][0])
    inputs.update(changes)
    return json.dumps(inputs)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"draft_tokens": [[1]]}), "missing key(s): draft_probs"),
        (_with(extra=1), "unknown key(s) for a chain step: extra"),
        (_with(draft_probs=[[[0.2, 0.8]]]), "draft_probs must have shape (B, G, V)"),
        (_with(draft_tokens=[[3.0, 2.0]]), "draft_tokens must have an integer dtype"),
        (_with(draft_tokens=[[3, "a"]]), "draft_tokens is not a rectangular array"),
        (
            _with(target_probs=[[[0.1], [0.2, 0.3]]]),
            "target_probs is not a rectangular",
        ),
        (_with(draft_tokens=[[3, 7]]), "row 0: draft_tokens must lie in [0, V)"),
        # Integers by value, however NumPy would read them: a mix of negative ones
        # and ones beyond int64 (float64 to NumPy), and ones beyond 64 bits.
        (_with(draft_tokens=[[2**63, -1]]), "row 0: draft_tokens must lie in [0, V)"),
        (_with(draft_tokens=[[2**70, 3]]), "row 0: draft_tokens must lie in [0, V)"),
        (_with(sample_uniforms=[1.0]), "sample_uniforms must lie in [0, 1)"),
    ],
)
def test_bad_input_gives_one_line_and_status_2(text, message, tmp_path, capsys):
    path = tmp_path / "inputs.json"
    path.write_text(text)
    status, out, err = _main(["run", str(path)], capsys)
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("speculax run: error: ")
    assert message in err


def test_run_reports_a_missing_file(capsys):
    status, _, err = _main(["run", "/nonexistent/inputs.json"], capsys)
    assert status == 2
    assert "cannot read /nonexistent/inputs.json" in err


def test_demo_matches_every_worked_example(capsys):
    status, out, _ = _main(["demo"], capsys)
    assert status == 0
    assert out.count("MATCH\n") == len(WORKED_EXAMPLES)
    assert "MISMATCH" not in out
    assert "random batch" in out
    assert "all worked examples match" in out


@pytest.mark.slow
def test_demo_loop_reports_each_verification_and_the_cache(capsys):
    status, out, err = _main(
        [
            "demo",
            "--loop",
            "--max-new-tokens",
            "12",
            # A chain from each drafter, Medusa's tree and a draft model's tree:
            # block verification and TreeStep in the loop are tests/test_loop.py's
            # and tests/test_loop_trees.py's, a tree of the EAGLE-style head's
            # tests/test_feature_heads.py's.
            "--verify",
            "chain",
            "prompt lookup",
            "Medusa",
            "EAGLE",
            "Medusa tree",
            "traversal",
            "--batch-sizes",
            "8",
            "--cache-lengths",
            "8",
            "--repeats",
            "1",
        ],
        capsys,
    )
    assert status == 0, err
    # Progress on standard error, a line as each run starts and as it ends; the
    # tables on standard output.
    lines = err.splitlines()
    assert lines[0] == (
        "speculax demo --loop: [1/7] target alone, 8 per call: compiling and timing ..."
    )
    assert lines[13].startswith("speculax demo --loop: [7/7] traversal, 8 per call: ")
    assert "8 new tokens, cacheless" in lines[15]
    assert len(lines) == 16 and "compiling" not in out
    names = ("target", "chain", "prompt", "Medusa", "EAGLE", "traversal")
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split() and line.split()[0] in names and "Medusa tree" not in line
    }
    assert rows["target"][1:][:4] == ["alone", "8", "0", "1.00"]
    assert rows["target"][-1] == "1.00x"
    # The trained draft agrees with the target often: more than one token a call.
    assert set(rows) == set(names)
    for name in ("chain", "traversal"):
        assert 1.3 < float(rows[name][3]) <= 7, name
    # Prompt lookup drafts without a model: 4 drafts, some of them kept.
    assert rows["prompt"][1:4] == ["lookup", "8", "4"]
    assert 1 < float(rows["prompt"][4]) <= 5
    # The heads on the target's features: 4 drafts, some of them kept; Medusa's
    # tree of 9 candidates keeps at most its depth, 4.
    for name in ("Medusa", "EAGLE"):
        assert rows[name][1:3] == ["8", "4"], name
        assert 1 < float(rows[name][3]) <= 5, name
    tree_rows = [line.split() for line in out.splitlines() if "Medusa tree" in line]
    assert len(tree_rows) == 1 and tree_rows[0][2:4] == ["8", "9"]
    assert 1 < float(tree_rows[0][4]) <= 5
    # One batch of 8 prompts: the target alone takes one call per token.
    assert rows["target"][5] == "12" and 2 <= int(rows["chain"][4]) < 12
    assert "def __init__(self, " in out
    cache_rows = [
        line.split() for line in out.splitlines() if line.startswith("         8")
    ]
    assert len(cache_rows) == 1


def test_version(capsys):
    import speculax

    with pytest.raises(SystemExit) as exit_info:
        _main(["--version"], capsys)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"speculax {speculax.__version__}\n"


def test_bench_help_lists_every_variant_and_dtype(monkeypatch, capsys):
    from speculax._cli._bench import DTYPES, VARIANTS

    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        _main(["bench", "--help"], capsys)
    text = capsys.readouterr().out
    assert f"variants: {', '.join(VARIANTS)};" in text
    assert f"dtypes: {', '.join(DTYPES)};" in text


# The deterministic example of the guide: 0.5 >= p_0(2) = 0.4 rejects, and y is
# drawn from [0.3, 0.3, 0] / 0.6 at s = 0.3.
_DETERMINISTIC = {
    "draft_tokens": [[2, 1]],
    "draft_probs": None,
    "target_probs": [[[0.3, 0.3, 0.4], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]],
    "accept_uniforms": [[0.5, 0.9]],
    "sample_uniforms": [0.3],
}


def test_run_takes_null_draft_probs_as_deterministic_drafts(tmp_path, capsys):
    status, out, err = _run_text(json.dumps(_DETERMINISTIC).encode(), tmp_path, capsys)
    assert status == 0, err
    assert json.loads(out) == {"num_accepted": [0], "tokens": [[0, -1, -1]]}


def test_run_draws_the_uniforms_from_a_seed(tmp_path, capsys):
    """`seed` instead of the two uniform arrays: the step's `key=jax.random.key(seed)`,
    and different seeds differ somewhere."""
    import jax

    import speculax

    inputs, _ = WORKED_EXAMPLES[1]
    unseeded = {k: v for k, v in inputs.items() if not k.endswith("_uniforms")}
    got = set()
    for seed in range(4):
        data = json.dumps({**unseeded, "seed": seed}).encode()
        status, out, err = _run_text(data, tmp_path, capsys)
        assert status == 0, err
        want = speculax.speculative_step(**unseeded, key=jax.random.key(seed))
        assert json.loads(out) == {
            name: want[name].tolist() for name in ("num_accepted", "tokens")
        }
        got.add(out)
    assert len(got) > 1


@pytest.mark.parametrize(
    "seed, message",
    [
        (1.5, "seed must be an integer; got 1.5"),
        (True, "seed must be an integer; got true"),
        (None, "seed must be an integer; got null"),
        ([[0]] * 10, "seed must be an integer; got [[0], [0], [0], [0],..."),
        (-1, "seed must lie in [0, 2^32); got -1"),
        (2**32, "seed must lie in [0, 2^32); got 4294967296"),
    ],
)
def test_run_rejects_a_bad_seed(seed, message, tmp_path, capsys):
    inputs = {k: v for k, v in _DETERMINISTIC.items() if not k.endswith("_uniforms")}
    data = json.dumps({**inputs, "seed": seed}).encode()
    _assert_one_line(*_run_text(data, tmp_path, capsys), message)


def test_run_rejects_a_seed_beside_uniforms(tmp_path, capsys):
    data = json.dumps({**_DETERMINISTIC, "seed": 0}).encode()
    _assert_one_line(*_run_text(data, tmp_path, capsys), "either seed or")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--num-draft", "0"], "must be a positive integer"),
        (["--verify", "greedy"], "invalid choice: 'greedy'"),
        (["--batch-sizes", "3"], "invalid choice: 3"),
        (["--cache-lengths", "0"], "must be a positive integer"),
        (["--cache-lengths", "none", "64"], "none stands alone"),
        (["--cache-lengths"], "expected at least one argument"),
        (["--verify", "Medusa", "--num-draft", "5"], "Medusa heads draft at most 4"),
    ],
)
def test_demo_loop_rejects_bad_arguments(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _main(["demo", "--loop", *arguments], capsys)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_loop_skips_the_cache_table_on_none(monkeypatch):
    import speculax._cli._command as command

    seen = []
    monkeypatch.setattr(command, "_demo_loop", lambda args: seen.append(args) or 0)
    assert command.main(["demo", "--loop", "--cache-lengths", "none"]) == 0
    assert command.main(["demo", "--loop", "--cache-lengths", "8", "16"]) == 0
    assert [args.cache_lengths for args in seen] == [[], [8, 16]]


def test_demo_loop_is_quick_unless_asked_for_the_full_comparison(monkeypatch):
    import speculax._cli._command as command
    from speculax._cli._demo import VERIFICATIONS

    seen = []
    monkeypatch.setattr(command, "_demo_loop", lambda args: seen.append(args) or 0)
    names = list(command.QUICK_DEMO)
    for arguments in (
        ["--loop"],
        ["--loop", "--full"],
        ["--full", "--loop", "--max-new-tokens", "8"],
    ):
        assert command.main(["demo", *arguments]) == 0
    quick, full, shorter = ({name: vars(args)[name] for name in names} for args in seen)
    assert quick == command.QUICK_DEMO and full == command.FULL_DEMO
    assert full["verify"] == [v for v in VERIFICATIONS if v != "target alone"]
    assert quick["max_new_tokens"] < full["max_new_tokens"]
    assert shorter == {**command.FULL_DEMO, "max_new_tokens": 8}


def _run_text(data: bytes, tmp_path, capsys) -> tuple[int, str, str]:
    path = tmp_path / "inputs.json"
    path.write_bytes(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status, out, err = _main(["run", str(path)], capsys)
    assert [str(warning.message) for warning in caught] == []
    return status, out, err


def _assert_one_line(status, out, err, message=""):
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("speculax run: error: "), err
    assert message in err


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\xff\xfe{\x00", "not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (_with(draft_tokens=[[2**70, 1]]).encode(), "draft_tokens must lie in [0, V)"),
        (_with(draft_tokens=[[2**32 + 3, 1]]).encode(), "draft_tokens must lie in"),
        (
            _with(sample_uniforms=[True]).encode(),
            "sample_uniforms is not a rectangular",
        ),
        (
            _with(sample_uniforms=[None]).encode(),
            "sample_uniforms is not a rectangular",
        ),
        (_with(sample_uniforms=[10**400]).encode(), "beyond float64's range"),
        (
            _with(target_probs=[[[1e39, 0.4, 0.3, 0.3]] * 3]).encode(),
            "target_probs holds a number beyond float32's range",
        ),
        # In a row the step never reads (the first example stops at position 1).
        (
            _with(
                target_probs=[[[0.1] * 4, [0.1] * 4, [1e39, 0.1, 0.1, 0.1]]]
            ).encode(),
            "target_probs holds a number beyond float32's range",
        ),
        (
            _with(draft_probs="INF").encode().replace(b'"INF"', b"[[[Infinity]]]"),
            "Infinity is not a JSON number",
        ),
        (_with(sample_uniforms="N").encode().replace(b'"N"', b"[NaN]"), "NaN is not"),
        (
            _with(sample_uniforms="N").encode().replace(b'"N"', b"[1e400]"),
            "the number 1e400 lies beyond float64's range",
        ),
        (
            _with().encode().replace(b"{", b'{"seed": 1, "seed": 2, ', 1),
            "duplicate key: seed",
        ),
        (
            _with(draft_tokens=[[[[[[[[[[3]]]]]]]]]]).encode(),
            "draft_tokens must have rank",
        ),
    ],
)
def test_malformed_input_gives_one_line_and_status_2(data, message, tmp_path, capsys):
    _assert_one_line(*_run_text(data, tmp_path, capsys), message)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["run", "a.json", "b.json"], "speculax: error: unrecognized arguments: b"),
        (["walk"], "speculax: error: argument command: invalid choice: 'walk'"),
        (["demo", "--loop", "--repeats", "x"], "speculax demo: error: argument"),
    ],
)
def test_a_bad_command_line_gives_one_line_and_status_2(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _main(arguments, capsys)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(message)


def test_integer_json_numbers_are_read_as_floats(tmp_path, capsys):
    """`0` and `1` where a float is expected (a one-hot row, a zero uniform) are the
    numbers they spell."""
    inputs, _ = WORKED_EXAMPLES[0]
    as_floats = {**inputs, "sample_uniforms": [0.0]}
    as_floats["target_probs"] = [[[0.0, 0.0, 0.0, 1.0], *inputs["target_probs"][0][1:]]]
    as_integers = {**as_floats, "sample_uniforms": [0]}
    as_integers["target_probs"] = [[[0, 0, 0, 1], *inputs["target_probs"][0][1:]]]
    results = []
    for case in (as_floats, as_integers):
        status, out, err = _run_text(json.dumps(case).encode(), tmp_path, capsys)
        assert status == 0, err
        results.append(json.loads(out))
    assert results[0] == results[1]
    # p_0(3) = 1 accepts the first draft token (3).
    assert results[1]["tokens"][0][0] == 3


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, 1, 0.5, 1e-39, 1e39, 2**31, 2**63])
    | st.text(max_size=3),
    lambda children: st.lists(children, max_size=4),
    max_leaves=12,
)


# `_main` reads capsys (and so empties it) on every call: sharing it is safe.
_SHARED_CAPSYS = [hypothesis.HealthCheck.function_scoped_fixture]


@hypothesis.settings(max_examples=60, suppress_health_check=_SHARED_CAPSYS)
@hypothesis.given(
    name=st.sampled_from(INPUT_NAMES),
    value=_json_values,
)
def test_any_value_gives_a_result_or_one_line(name, value, tmp_path_factory, capsys):
    """One input replaced by anything JSON can hold: a result, or one line and 2."""
    inputs = dict(WORKED_EXAMPLES[0][0])
    inputs[name] = value
    path = tmp_path_factory.mktemp("fuzz")
    status, out, err = _run_text(json.dumps(inputs).encode(), path, capsys)
    if status == 0:
        assert set(json.loads(out)) == {"num_accepted", "tokens"}
    else:
        _assert_one_line(status, out, err)


@hypothesis.settings(max_examples=40, suppress_health_check=_SHARED_CAPSYS)
@hypothesis.given(data=st.binary(max_size=64))
def test_any_bytes_give_one_line(data, tmp_path_factory, capsys):
    path = tmp_path_factory.mktemp("bytes")
    _assert_one_line(*_run_text(data, path, capsys))


def test_the_documented_usage_is_the_parser_s(monkeypatch, capsys):
    """The usage block at the top of docs/cli.md is `speculax --help`, verbatim."""
    from pathlib import Path

    from speculax._cli._command import main

    page = (Path(__file__).resolve().parent.parent / "docs/cli.md").read_text()
    documented = page.split("```text\n", 1)[1].split("```\n", 1)[0]
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out == documented


_TREE = {
    # Two children of the root, tokens 1 and 2; node 2 has a child, token 0.
    "parents": [[0, 0, 2], [0, 1, 1]],
    "tree_tokens": [[1, 2, 0], [2, 0, 1]],
    "draft_probs": [
        [[0.2, 0.3, 0.5], [0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]],
        [[0.2, 0.2, 0.6], [0.6, 0.2, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]],
    ],
    "target_probs": [
        [[0.1, 0.3, 0.6], [1.0, 0.0, 0.0], [0.2, 0.5, 0.3], [0.0, 0.0, 1.0]],
        [[0.1, 0.1, 0.8], [0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]],
    ],
    "accept_uniforms": [[0.5, 0.2, 0.9], [0.1, 0.7, 0.3]],
    "sample_uniforms": [0.4, 0.8],
}
_LOGITS = {
    "draft_tokens": [[2, 1], [0, 0], [1, 2]],
    "draft_logits": [
        [[0.1, 0.3, 2.0], [0.5, 1.5, 0.0]],
        [[2.0, 0.3, 0.1], [1.5, 0.5, 0.0]],
        [[0.1, 2.0, 0.3], [0.0, 0.5, 1.5]],
    ],
    "target_logits": [[[0.1, 0.3, 1.6], [1.0, 0.0, 0.0], [0.2, 0.5, 0.3]]] * 3,
    "accept_uniforms": [[0.3, 0.6], [0.9, 0.1], [0.2, 0.4]],
    "sample_uniforms": [0.7, 0.2, 0.5],
    "temperature": [0.0, 0.7, 1.3],
    "top_k": [0, 2, 0],
    "top_p": 0.9,
}


def _run_json(inputs, tmp_path, capsys):
    status, out, err = _run_text(json.dumps(inputs).encode(), tmp_path, capsys)
    assert status == 0, err
    return json.loads(out)


def test_run_verifies_a_tree_given_parents(tmp_path, capsys):
    """An object with `parents` runs `TreeStep`, on its uniforms or drawn from a
    seed, deterministic drafts for `draft_probs: null`; the output holds the
    accepted nodes too."""
    import jax
    import numpy as np

    import speculax

    # Jitted: the step op by op takes seconds.
    step = eqx.filter_jit(speculax.TreeStep())
    seeded = {k: v for k, v in _TREE.items() if not k.endswith("_uniforms")}
    cases = [
        (_TREE, step(**_TREE)),
        ({**seeded, "seed": 5}, step(**seeded, key=jax.random.key(5))),
        (
            {**_TREE, "draft_probs": None},
            step(**{**_TREE, "draft_probs": None}),
        ),
    ]
    for inputs, want in cases:
        assert _run_json(inputs, tmp_path, capsys) == {
            name: np.asarray(want[name]).tolist()
            for name in ("num_accepted", "tokens", "accepted_nodes")
        }


def test_run_verifies_logits_under_sampling_parameters(tmp_path, capsys):
    """An object with `target_logits` runs `LogitsStep`, its temperature, top-k
    and top-p given one per row or one for all (one compilation, which the bad
    parameters below share)."""
    import numpy as np

    import speculax

    arrays = {
        k: np.asarray(v) if isinstance(v, list) else v for k, v in _LOGITS.items()
    }
    want = eqx.filter_jit(speculax.LogitsStep())(**arrays)
    assert _run_json(_LOGITS, tmp_path, capsys) == {
        name: np.asarray(want[name]).tolist() for name in ("num_accepted", "tokens")
    }


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({**_TREE, "target_logits": [[[0.0]]]}, "give parents (a tree step) or"),
        ({**_TREE, "temperature": 0.5}, "unknown key(s) for a tree step: temperature"),
        ({**_LOGITS, "target_probs": [[[0.5]]]}, "for a logits step: target_probs"),
        ({**_TREE, "parents": [[0, 2**32, 2], [0, 1, 1]]}, "row 0: parents"),
        ({**_TREE, "tree_tokens": [[1, 2, 0], [2, 2**32, 1]]}, "row 1: tree_tokens"),
        ({**_LOGITS, "temperature": -1}, "temperature must be finite"),
        ({**_LOGITS, "temperature": [0.5, -1, 1]}, "row 1: temperature"),
        ({**_LOGITS, "top_k": 1.5}, "top_k must have an integer dtype"),
        ({**_LOGITS, "top_p": [0.5, True, 1]}, "top_p is not a rectangular array"),
        (
            {k: v for k, v in _LOGITS.items() if k != "draft_logits"},
            "missing key(s): draft_logits",
        ),
    ],
)
def test_run_refuses_bad_trees_and_logits_in_one_line(
    inputs, message, tmp_path, capsys
):
    data = json.dumps(inputs).encode()
    _assert_one_line(*_run_text(data, tmp_path, capsys), message)
