"""`attnres-probe` from a clone: causal routing probes on runs' checkpoints
(attnres/training/probe_runs.py).

    python experiments/probe_routing.py RUN_OR_SWEEP [options]   # the same as: attnres-probe RUN_OR_SWEEP ...
"""

import sys

from attnres.training.probe_runs import main

if __name__ == "__main__":
    sys.exit(main())
