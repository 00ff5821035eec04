"""Generation engines: the ``RolloutEngine`` Protocol (``base.py``), groupflow's own HF decode loop
with its continuous batching and static KV cache, the colocated vLLM engine, and the batching of
prompt rows into fixed-width samples.

Design decision: nothing is re-exported here (each engine imports what it needs), so importing the
Protocol never imports vLLM."""
