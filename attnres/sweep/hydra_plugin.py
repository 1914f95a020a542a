"""Hydra finds launchers only under the `hydra_plugins` namespace package, by the module the
class is defined in: the wheel maps this file to `hydra_plugins/attnres_launcher/__init__.py`
(see pyproject.toml), so that `hydra/launcher=parallel` can name
`hydra_plugins.attnres_launcher.ParallelLauncher` (and `hydra/launcher=slurm`
`hydra_plugins.attnres_launcher.SlurmLauncher`), and the tuned sweeper (`hydra/sweeper=tuned`,
chosen by `tune=lr`) `hydra_plugins.attnres_launcher.TunedSweeper`. The code is in attnres.sweep.launcher,
attnres.sweep.tuned and attnres.sweep.slurm (which needs the `slurm` extra: hydra-submitit-launcher)."""

from attnres.sweep import launcher, tuned


class TunedSweeper(tuned.TunedSweeper):
    __doc__ = tuned.TunedSweeper.__doc__


class ParallelLauncher(launcher.ParallelLauncher):
    __doc__ = launcher.ParallelLauncher.__doc__


try:
    from attnres.sweep import slurm
except ImportError:  # no hydra-submitit-launcher: hydra/launcher=slurm says so when chosen
    pass
else:

    class SlurmLauncher(slurm.SlurmLauncher):
        __doc__ = slurm.SlurmLauncher.__doc__
