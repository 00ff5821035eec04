"""Generation: the ``RolloutEngine`` Protocol (``engine.py``), groupflow's own HF decode loop with
its continuous batching and static KV cache, the colocated vLLM engine, and the batching of prompt
rows into fixed-width samples. Nothing is re-exported here (each engine imports what it needs)."""
