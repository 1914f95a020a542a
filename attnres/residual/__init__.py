"""Residual strategies: one small module each behind `ResidualStrategy`."""

from attnres.residual.base import DepthAttentionResidual, DepthRecord, ResidualStrategy
from attnres.residual.block import BlockAttentionResidual
from attnres.residual.denseformer import DenseFormerResidual
from attnres.residual.encoder import TransformerEncoder
from attnres.residual.full import FullAttentionResidual
from attnres.residual.hc import HyperConnectionResidual
from attnres.residual.mhc import ManifoldHyperConnectionResidual
from attnres.residual.standard import StandardResidual

__all__ = [
    "BlockAttentionResidual",
    "DenseFormerResidual",
    "DepthAttentionResidual",
    "DepthRecord",
    "FullAttentionResidual",
    "HyperConnectionResidual",
    "ManifoldHyperConnectionResidual",
    "ResidualStrategy",
    "StandardResidual",
    "TransformerEncoder",
]
