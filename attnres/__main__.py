"""`python -m attnres ...` is `attnres-run ...`."""

from __future__ import annotations

from attnres._entry import main

main()
