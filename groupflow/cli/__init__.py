"""The ``groupflow`` command: its parser and dispatch (``commands.py``), one module per command
or group of commands sharing their imports (``train``, ``inference`` for eval/generate/export,
``serve``, ``convert_gguf``, ``prepare_gsm8k``, ``pretrain_diffusion``; ``plot`` is
``plotting.py``'s), its error reporting (``errors.py``) and the plots it draws (``plotting.py``).

Design decision: nothing is re-exported here, so ``groupflow.cli.commands.main`` is the one entry
point (``python -m groupflow.cli`` runs it through ``__main__``)."""
