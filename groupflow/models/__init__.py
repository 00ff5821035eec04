"""Models and what training needs from them: HF causal LMs and tiny builds, vision-language
forwards, value heads, chunked LM-head log-probs, sequence parallelism, GGUF conversion. Nothing is
re-exported here (each module is imported where it is used)."""
