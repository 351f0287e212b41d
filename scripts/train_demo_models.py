"""Trains the demo's draft and target models and writes their weights into the
package, src/speculax/_cli/_demo/weights/{draft,target}.eqx, which
`speculax._cli._demo.load_demo_models` reads.

Both are byte-level `CausalTransformer`s with a key-value cache (the hyperparameters
in src/speculax/_cli/_demo/_shipped.py), trained with Adam on random rows of the source
of some standard-library modules (`speculax._cli._demo.corpus`), with fixed seeds; the
last twentieth of that text is held out, and the loss on it printed, in nats per byte.
About two minutes for the draft and fifteen for the target on two CPU cores:

    python scripts/train_demo_models.py [--output-dir src/speculax/_cli/_demo/weights]
"""

import argparse
import time
from pathlib import Path

import jax

from speculax._cli._demo import (
    DRAFT_HYPERPARAMETERS,
    TARGET_HYPERPARAMETERS,
    CausalTransformer,
    corpus,
    held_out_loss,
    save_model,
    split_corpus,
    train,
)
from speculax._cli._demo._shipped import DRAFT_WEIGHTS, TARGET_WEIGHTS


DEFAULT_OUTPUT_DIR = (
    Path(__file__).resolve().parent.parent / "src/speculax/_cli/_demo/weights"
)
# (name, hyperparameters, file, steps, peak learning rate, seed); rows of 128
# predictions, 32 a step.
MODELS = (
    ("draft", DRAFT_HYPERPARAMETERS, DRAFT_WEIGHTS, 1500, 3e-3, 0),
    ("target", TARGET_HYPERPARAMETERS, TARGET_WEIGHTS, 800, 2e-3, 1),
)
BATCH_SIZE = 32
LENGTH = 128


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Trains the demo's draft and target models."
    )
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    train_tokens, held_out = split_corpus(corpus())
    print(
        f"corpus: {len(train_tokens)} training bytes, {len(held_out)} held out "
        f"({time.perf_counter() - start:.1f} s)"
    )
    for name, hyperparameters, file, steps, learning_rate, seed in MODELS:
        model_start = time.perf_counter()
        init_key, train_key = jax.random.split(jax.random.key(seed))
        model = CausalTransformer(**hyperparameters, key=init_key)
        model, losses = train(
            model,
            train_tokens,
            steps=steps,
            key=train_key,
            batch_size=BATCH_SIZE,
            length=LENGTH,
            learning_rate=learning_rate,
            callback=lambda done, loss, name=name: print(
                f"{name}: step {done}, training loss {loss:.3f}", flush=True
            ),
        )
        save_model(model, args.output_dir / file)
        loss = held_out_loss(model, held_out)
        print(
            f"{name}: {steps} steps, last training loss {losses[-50:].mean():.3f}, "
            f"held-out loss {loss:.3f} nats/byte "
            f"({time.perf_counter() - model_start:.1f} s)"
        )
    print(f"total: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
