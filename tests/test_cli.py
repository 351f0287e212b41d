"""The command line: `speculax demo` and `speculax run`."""

import json
import subprocess
import sys

import pytest

from test_examples import WORKED_EXAMPLES


def _main(argv, capsys):
    from speculax._cli import main

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
        (_with(extra=1), "unknown key(s): extra"),
        (_with(draft_probs=[[[0.2, 0.8]]]), "draft_probs must have shape (B, G, V)"),
        (_with(draft_tokens=[[3.0, 2.0]]), "draft_tokens must have an integer dtype"),
        (_with(draft_tokens=[[3, "a"]]), "draft_tokens is not a rectangular array"),
        (
            _with(target_probs=[[[0.1], [0.2, 0.3]]]),
            "target_probs is not a rectangular",
        ),
        (_with(draft_tokens=[[3, 7]]), "draft_tokens must lie in [0, V) = [0, 4)"),
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
