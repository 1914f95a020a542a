"""`python -m attnres ...` is `attnres-run ...`."""

from attnres._entry import main

main()
