"""Trains the demo's draft heads on the shipped target's features and writes their
weights into the package, src/speculax/_cli/_demo/weights/{medusa,eagle}.eqx, which
`speculax._cli._demo.load_demo_heads` reads.

Medusa's heads (four) and the EAGLE-style head read the target's last hidden
states, normed (`CausalTransformer.features`), and share its embedding and LM head,
which stay as they are: only each head's residual block (and EAGLE's fusing layer)
is trained, with Adam on random rows of the corpus the target was trained on, with a
fixed seed. The held-out loss of each is printed, in nats per predicted byte, beside
the target's own LM head on the same predictions (Medusa's head k: the token
k + 2 after the feature's; EAGLE: the token 2 after, from the feature and the token
between). A few minutes on two CPU cores:

    python scripts/train_demo_heads.py [--output-dir src/speculax/_cli/_demo/weights]
"""

import argparse
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from speculax._cli._demo import corpus, load_demo_models, split_corpus, train
from speculax._cli._demo._heads import (
    EAGLE_WEIGHTS,
    MEDUSA_WEIGHTS,
    heads_loss,
    initial_weights,
    save_heads,
)


DEFAULT_OUTPUT_DIR = (
    Path(__file__).resolve().parent.parent / "src/speculax/_cli/_demo/weights"
)
STEPS = 600
LEARNING_RATE = 3e-3
BATCH_SIZE = 32
LENGTH = 128
HELD_OUT_ROWS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description="Trains the demo's draft heads.")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    args = parser.parse_args()
    start = time.perf_counter()
    _, target = load_demo_models()
    train_tokens, held_out = split_corpus(corpus())

    def loss(weights, rows):
        features = jax.lax.stop_gradient(target.features_all(rows))
        return sum(heads_loss(target, *weights, rows, features))

    weights, losses = train(
        initial_weights(target),
        train_tokens,
        steps=STEPS,
        key=jax.random.key(2),
        batch_size=BATCH_SIZE,
        length=LENGTH,
        learning_rate=LEARNING_RATE,
        callback=lambda done, mean: print(f"step {done}: loss {mean:.3f}", flush=True),
        loss=loss,
    )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    save_heads(weights[0], args.output_dir / MEDUSA_WEIGHTS)
    save_heads(weights[1], args.output_dir / EAGLE_WEIGHTS)

    count = len(held_out) // (LENGTH + 1)
    rows = np.asarray(held_out[: count * (LENGTH + 1)], np.int32)
    rows = jnp.asarray(rows.reshape(count, LENGTH + 1)[:HELD_OUT_ROWS])
    features = eqx.filter_jit(target.features_all)(rows)
    trained = eqx.filter_jit(heads_loss)(target, *weights, rows, features)
    untrained = eqx.filter_jit(heads_loss)(
        target, *initial_weights(target), rows, features
    )
    for name, after, before in zip(
        ("Medusa", "EAGLE"), trained, untrained, strict=True
    ):
        print(
            f"{name}: held-out loss {float(after):.3f} (untrained: "
            f"{float(before):.3f}), last training loss of both "
            f"{losses[-50:].mean():.3f}"
        )
    print(f"total: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
