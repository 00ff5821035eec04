"""A run's own files: its directory, checkpoints, resolved config, metric logs, trackers and health checks.

Design decision: everything a run writes beside its weights and reads back on resume lives in one
room, so the checkpoint layout, the metric files and the trackers that write them are read together.
Nothing is re-exported here (import the module that holds a name)."""
