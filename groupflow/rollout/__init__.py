"""The rollout service: where the driver's batches come from and how weights reach what generates.

Design decision: one room for the whole route, read top-down: ``source.py`` (the ``RolloutSource``
the driver asks: now, or ahead with a scheduled version), ``hosts.py`` (the driver's handle on the
asynchronous side, hosted in a child process, a thread or a Ray actor), ``ray_host.py`` (that Ray
actor on a rollout pool), ``side.py`` (the side's collect loop), ``weight_ring.py`` (the shared
memory the local route publishes versions into) and ``engines/`` (the decode engines behind the
``RolloutEngine`` Protocol). Nothing is re-exported here."""
