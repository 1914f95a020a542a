"""`attnres-summarize` from a clone: a sweep's summary rebuilt from its run folders
(attnres/results/summarize.py).

    python experiments/summarize.py SWEEP_DIR [...] [--out DIR]   # the same as: attnres-summarize SWEEP_DIR ...
"""

import sys

from attnres.results.summarize import main

if __name__ == "__main__":
    sys.exit(main())
