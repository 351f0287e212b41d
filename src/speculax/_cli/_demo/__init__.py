"""Two small byte-level transformers with key-value caches for demonstrations of
speculative decoding: a draft and a target, trained on the source of some
standard-library modules, with their weights shipped in the package.

**Example:**

```python
import jax.numpy as jnp
from speculax._cli._demo import decode, encode, load_demo_models

draft, target = load_demo_models()
tokens = jnp.asarray(encode("def __init__(self"))[None, :]
positions = jnp.array([[tokens.shape[1] - 1]])
logits = target.read(tokens, positions)  # (1, 1, 256)
print(decode([int(logits[0, 0].argmax())]))
```
"""

from ._corpus import (
    CORPUS_MODULES as CORPUS_MODULES,
    corpus as corpus,
    decode as decode,
    encode as encode,
    split_corpus as split_corpus,
)
from ._measure import (
    PROMPTS as PROMPTS,
    TREE_PATHS as TREE_PATHS,
    VERIFICATIONS as VERIFICATIONS,
    CacheMeasurement as CacheMeasurement,
    LoopMeasurement as LoopMeasurement,
    demo_loop as demo_loop,
    measure_cache as measure_cache,
    measure_loop as measure_loop,
)
from ._models import CausalTransformer as CausalTransformer
from ._shipped import (
    DRAFT_HYPERPARAMETERS as DRAFT_HYPERPARAMETERS,
    TARGET_HYPERPARAMETERS as TARGET_HYPERPARAMETERS,
    load_demo_models as load_demo_models,
    load_model as load_model,
    save_model as save_model,
)
from ._training import (
    held_out_loss as held_out_loss,
    sequence_loss as sequence_loss,
    train as train,
)
