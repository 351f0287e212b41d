"""speculax: the verification step of speculative decoding, exact and composable."""

import importlib.metadata

from ._acceptance import (
    AbstractAcceptance as AbstractAcceptance,
    RatioAcceptance as RatioAcceptance,
)
from ._prefix import AbstractPrefixCount as AbstractPrefixCount, PrefixCount as PrefixCount
from ._residual import AbstractResidual as AbstractResidual, Residual as Residual
from ._sampling import AbstractSampler as AbstractSampler, InverseCDF as InverseCDF
from ._step import (
    SpeculativeStep as SpeculativeStep,
    StepOutput as StepOutput,
    speculative_step as speculative_step,
)


__version__ = importlib.metadata.version("speculax")
