"""attnres: Attention Residuals (Kimi Team, arXiv 2603.15031) in plain PyTorch.

`import attnres` loads only torch: functional ops, residual strategies (drop-in modules),
`TransformerEncoder` (torch's, with `residual=`) and the Transformer. The Lightning/Hydra
runner lives in `attnres.training` and `cli.py`.
"""

from attnres import functional
from attnres.model import Transformer
from attnres.residual import (
    BlockAttentionResidual,
    DepthAttentionResidual,
    DepthRecord,
    FullAttentionResidual,
    ResidualStrategy,
    StandardResidual,
    TransformerEncoder,
)

__version__ = "0.1.0"

__all__ = [
    "BlockAttentionResidual",
    "DepthAttentionResidual",
    "DepthRecord",
    "FullAttentionResidual",
    "ResidualStrategy",
    "StandardResidual",
    "Transformer",
    "TransformerEncoder",
    "functional",
]
