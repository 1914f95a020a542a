"""Hydra finds launchers only under the `hydra_plugins` namespace package, by the module the
class is defined in: the wheel maps this file to `hydra_plugins/attnres_launcher/__init__.py`
(see pyproject.toml), so that `hydra/launcher=parallel` can name
`hydra_plugins.attnres_launcher.ParallelLauncher`. The code is in attnres.training.sweep."""

from attnres.training import sweep


class ParallelLauncher(sweep.ParallelLauncher):
    __doc__ = sweep.ParallelLauncher.__doc__
