"""The calculator-tool task as overrides of the tiny config (``tiny_config(**CALC_TOOLS)``): 2-digit
problems, up to 2 turns, the built-in calculator behind ``<calc>`` tags. Shared by the multi-turn,
policy-view, rollout-host and rollout-spec tests, which add what each needs (a warm start, a
temperature, fewer rows)."""

CALC_TOOLS = dict(
    data__task={"name": "calc", "digits": 2, "num_train": 200, "num_val": 8},
    model__tiny={"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_positions": 80},
    rollout__max_turns=2, rollout__max_new_tokens=20, rollout__max_response_tokens=40,
    rollout__stop=["</calc>"], rollout__tools=[{"name": "calculator", "label": "calc"}],
    rollout__tool_parser="tag", rollout__observation_template="={content}\n",
)  # fmt: skip
