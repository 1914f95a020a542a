"""The `attnres-run` console script.

In a wheel, `cli.py` and `conf/` are mapped into this package at build time; in a source
checkout (an editable install) they stay at the top of the repository, beside it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def main() -> None:
    # As with `python -m`, the current folder is importable, so a strategy in ./my_residual.py
    # plugs in with `residual._target_=my_residual.MyResidual`.
    if "" not in sys.path and sys.path[0] != str(Path.cwd()):
        sys.path.insert(0, str(Path.cwd()))
    if importlib.util.find_spec("attnres.cli") is not None:
        from attnres import cli
    else:
        path = Path(__file__).resolve().parent.parent / "cli.py"
        spec = importlib.util.spec_from_file_location("attnres_cli", path)
        if spec is None or spec.loader is None or not path.is_file():
            raise SystemExit(f"attnres-run: cannot find cli.py beside the attnres package ({path}); reinstall attnres")
        cli = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = cli
        spec.loader.exec_module(cli)
        # sweep workers cannot import this module by name: send its functions by value
        import cloudpickle

        cloudpickle.register_pickle_by_value(cli)
    cli.main()
