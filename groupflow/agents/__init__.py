"""Everything a multi-turn rollout talks to: tools, tool-call parsers, environments, and the token
formats that append their observations to a conversation without re-encoding the model's text."""
