"""`attnres-plot` from a clone: a run's dashboard figures as PNG files (attnres/results/plot_run.py).

    python experiments/plot_run.py RUN_DIR [--out DIR] [--step N]   # the same as: attnres-plot RUN_DIR ...
"""

import sys

from attnres.results.plot_run import compare, find_runs, main, plot_run, read_figure_data  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
