"""The experiment runner's library: Lightning module, data modules, schedules, callbacks.

Imports Lightning; `import attnres` alone does not load this package.
"""

from attnres.training.errors import ConfigError
from attnres.training.lit import LitLanguageModel, parameter_groups

__all__ = ["ConfigError", "LitLanguageModel", "parameter_groups"]
