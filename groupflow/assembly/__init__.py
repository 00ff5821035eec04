"""Assembly: turn the typed config into plain objects — tokenizer and processor, model, data,
rewards, rollout engine and weight transport, worker groups — one module per kind of part.

Design decision: this package is the one place that reads config sections to construct things;
the objects it returns take plain arguments and never see the config again (style.md principle
6). Its modules are split by what they build, import only downward (config, data, models,
rewards, rollout engines, distributed), and this ``__init__`` imports none of them, so a worker
that builds its model in its own process (``assembly.models``) loads no more than that.
"""
