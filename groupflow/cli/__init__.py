"""The ``groupflow`` command: its subcommands (``commands.py``), its error reporting (``errors.py``)
and the plots it draws (``plotting.py``).

Design decision: nothing is re-exported here, so ``groupflow.cli.commands.main`` is the one entry
point (``python -m groupflow.cli`` runs it through ``__main__``)."""
