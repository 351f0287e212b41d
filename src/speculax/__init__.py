"""speculax: the verification step of speculative decoding, exact and composable."""

import importlib.metadata

from ._acceptance import (
    AbstractAcceptance as AbstractAcceptance,
    BlockAcceptance as BlockAcceptance,
    GreedyAcceptance as GreedyAcceptance,
    RatioAcceptance as RatioAcceptance,
    TypicalAcceptance as TypicalAcceptance,
)
from ._diagnostics import (
    StepDiagnostics as StepDiagnostics,
    diagnose as diagnose,
)
from ._failures import (
    RESULTS as RESULTS,
    failure_messages as failure_messages,
)
from ._input_array import InputArray as InputArray
from ._logits._probs import probs_from_logits as probs_from_logits
from ._logits._step import LogitsStep as LogitsStep
from ._loop import (
    ACCEPT as ACCEPT,
    DRAFT as DRAFT,
    SAMPLE as SAMPLE,
    AbstractKeySchedule as AbstractKeySchedule,
    FoldInKeys as FoldInKeys,
    LanguageModel as LanguageModel,
    LoopOutput as LoopOutput,
    LoopState as LoopState,
    SpeculativeLoop as SpeculativeLoop,
)
from ._prefix import (
    AbstractPrefixCount as AbstractPrefixCount,
    LastPassCount as LastPassCount,
    PrefixCount as PrefixCount,
)
from ._random import KeyArray as KeyArray, uniforms as uniforms
from ._residual import (
    AbstractResidual as AbstractResidual,
    BlockResidual as BlockResidual,
    Residual as Residual,
    TargetRow as TargetRow,
)
from ._sampling import (
    AbstractSampler as AbstractSampler,
    Argmax as Argmax,
    InverseCDF as InverseCDF,
)
from ._sharded import sharded_step as sharded_step
from ._step import (
    SpeculativeStep as SpeculativeStep,
    StepOutput as StepOutput,
    block_step as block_step,
    greedy_step as greedy_step,
    speculative_step as speculative_step,
)
from ._token_major import (
    from_token_major as from_token_major,
    to_token_major as to_token_major,
)
from ._traversal import TraversalStep as TraversalStep
from ._tree import (
    AbstractSiblingRule as AbstractSiblingRule,
    AbstractTreeStep as AbstractTreeStep,
    IndependentSiblings as IndependentSiblings,
    SiblingsWithoutReplacement as SiblingsWithoutReplacement,
    TreeOutput as TreeOutput,
    TreeStep as TreeStep,
)
from ._tree_formats import (
    parents_from_paths as parents_from_paths,
    tree_from_linked_lists as tree_from_linked_lists,
)


__version__ = importlib.metadata.version("speculax")
