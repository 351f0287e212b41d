"""speculax: the verification step of speculative decoding, exact and composable."""

import importlib.metadata

from ._chain._diagnostics import (
    StepDiagnostics as StepDiagnostics,
    diagnose as diagnose,
)
from ._chain._step import (
    SpeculativeStep as SpeculativeStep,
    StepOutput as StepOutput,
    block_step as block_step,
    greedy_step as greedy_step,
    speculative_step as speculative_step,
)
from ._core._failures import (
    RESULTS as RESULTS,
    failure_messages as failure_messages,
)
from ._core._row_strategy import row_strategy as row_strategy
from ._drafters._eagle import EagleHead as EagleHead
from ._drafters._features import TargetFeatures as TargetFeatures
from ._drafters._medusa import MedusaHeads as MedusaHeads
from ._drafters._prompt_lookup import PromptLookup as PromptLookup
from ._inputs._input_array import InputArray as InputArray
from ._inputs._random import KeyArray as KeyArray, uniforms as uniforms
from ._inputs._token_major import (
    from_token_major as from_token_major,
    to_token_major as to_token_major,
)
from ._inputs._tree_formats import (
    parents_from_paths as parents_from_paths,
    tree_from_linked_lists as tree_from_linked_lists,
)
from ._logits._probs import probs_from_logits as probs_from_logits
from ._logits._step import LogitsStep as LogitsStep
from ._loop._cache import (
    AbstractCachedModel as AbstractCachedModel,
    Cacheless as Cacheless,
    FullRead as FullRead,
)
from ._loop._draft_tree import DraftTree as DraftTree
from ._loop._drafter import (
    AbstractDrafter as AbstractDrafter,
    DraftRows as DraftRows,
    Drafts as Drafts,
)
from ._loop._dynamic_tree import DynamicTree as DynamicTree
from ._loop._keys import (
    ACCEPT as ACCEPT,
    DRAFT as DRAFT,
    SAMPLE as SAMPLE,
    AbstractKeySchedule as AbstractKeySchedule,
    FoldInKeys as FoldInKeys,
)
from ._loop._loop import SpeculativeLoop as SpeculativeLoop
from ._loop._model import LanguageModel as LanguageModel
from ._loop._model_drafter import ModelDrafter as ModelDrafter
from ._loop._sampling import (
    AbstractDraftSampling as AbstractDraftSampling,
    RowParameters as RowParameters,
    SameAsTarget as SameAsTarget,
)
from ._loop._state import LoopOutput as LoopOutput, LoopState as LoopState
from ._pieces._acceptance import (
    AbstractAcceptance as AbstractAcceptance,
    BlockAcceptance as BlockAcceptance,
    GreedyAcceptance as GreedyAcceptance,
    RatioAcceptance as RatioAcceptance,
    TypicalAcceptance as TypicalAcceptance,
)
from ._pieces._prefix import (
    AbstractPrefixCount as AbstractPrefixCount,
    LastPassCount as LastPassCount,
    PrefixCount as PrefixCount,
)
from ._pieces._residual import (
    AbstractFusedResidual as AbstractFusedResidual,
    AbstractResidual as AbstractResidual,
    BlockResidual as BlockResidual,
    Residual as Residual,
    TargetRow as TargetRow,
)
from ._pieces._sampling import (
    AbstractBlockSumSampler as AbstractBlockSumSampler,
    AbstractSampler as AbstractSampler,
    Argmax as Argmax,
    InverseCDF as InverseCDF,
)
from ._sharded._step import sharded_step as sharded_step
from ._tree._abstract import (
    AbstractTreeStep as AbstractTreeStep,
    TreeOutput as TreeOutput,
)
from ._tree._child_tests import (
    AbstractChildTest as AbstractChildTest,
    GreedyChildTest as GreedyChildTest,
    RatioChildTest as RatioChildTest,
)
from ._tree._recursive import (
    TreeStep as TreeStep,
    greedy_tree_step as greedy_tree_step,
)
from ._tree._siblings import (
    AbstractSiblingRule as AbstractSiblingRule,
    IndependentSiblings as IndependentSiblings,
    SiblingsWithoutReplacement as SiblingsWithoutReplacement,
)
from ._tree._traversal import TraversalStep as TraversalStep


__version__ = importlib.metadata.version("speculax")
