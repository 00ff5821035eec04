"""``python -m groupflow.cli``: the ``groupflow`` command (tests start servers and runs this way).

Design decision: a two-line shim, so that the subprocess form and the console script run one
``main``."""

from groupflow.cli.commands import main

raise SystemExit(main())
