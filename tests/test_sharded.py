"""`speculax.sharded_step` on 8 simulated CPU devices.

The device count is fixed when JAX initialises, and this process already runs JAX on
one device, so the checks run in a subprocess (`tests/sharded_checks.py`, compiling
once per mesh) and this file asserts on the JSON it prints.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


HERE = Path(__file__).resolve().parent
VOCAB = 8 * 256 * 2


@pytest.fixture(scope="module")
def result() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run(
        [sys.executable, str(HERE / "sharded_checks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


MESHES = ["8x1", "1x8", "2x4", "4x2", "vocab8", "batch8"]


def test_inputs_cover_the_branches(result):
    # Row 0 accepts every draft (n = G); row 2 stops at a zero residual (n = 0).
    for counts in result["num_accepted"]:
        assert counts[0] == 3
        assert counts[2] == 0


@pytest.mark.parametrize("mesh", MESHES)
def test_identical_to_single_device(result, mesh):
    assert result[mesh]["identical"]


@pytest.mark.parametrize("mesh", MESHES)
def test_no_vocabulary_sized_collective(result, mesh):
    assert result[mesh]["large_collectives"] == []


@pytest.mark.parametrize("mesh", ["1x8", "2x4", "4x2", "vocab8"])
def test_vocab_sharding_communicates(result, mesh):
    # The psums of p_i(x_i), q_i(x_i) and of the row masses, the all_gather of the
    # block sums and the pmax of the token: proof that the parser sees the
    # collectives it is meant to bound.
    assert result[mesh]["collectives"] >= 3


def test_indivisible_vocabulary(result):
    message = result["indivisible"]
    assert message is not None
    assert "divisible" in message and "vocab_axis" in message


def test_value_checks_run(result):
    assert result["bad_token"] is not None
    assert f"draft_tokens must lie in [0, V) = [0, {VOCAB})" in result["bad_token"]


def test_integer_tokens_are_read_by_value(result):
    assert result["int16_identical"]
    message = result["int64_token"]
    assert message is not None and "draft_tokens must lie in [0, V)" in message


def test_an_overflowing_row_names_target_probs(result):
    message = result["overflow"]
    assert message is not None and "target_probs must have rows whose total" in message


def test_non_default_pieces_rejected(result):
    message = result["non_default"]
    assert message is not None and "GreedyAcceptance" in message


def test_structure_errors_on_one_device():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import speculax

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "vocab"))
    with pytest.raises(ValueError, match="vocab_axis must be one of"):
        speculax.sharded_step(speculax.SpeculativeStep(), mesh, vocab_axis="model")
    f = speculax.sharded_step(
        speculax.SpeculativeStep(), mesh, batch_axis="data", vocab_axis="vocab"
    )
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        f(
            np.zeros((1, 2), np.int32),
            np.full((1, 2, 5), 0.2, np.float32),
            np.full((1, 3, 4), 0.25, np.float32),
            np.zeros((1, 2), np.float32),
            np.zeros((1,), np.float32),
        )
