"""Reward functions that break the reward contract, for the CLI's error-message tests (imported
by path: ``bad_rewards:wrong_length``; the ``helpers_on_path`` fixture puts tests/ on sys.path)."""


def wrong_length(prompts, completions, answer):
    return [1.0]


def strings(prompts, completions, answer):
    return ["good"] * len(completions)


def always_fails(prompts, completions, answer):
    raise ZeroDivisionError("my reward divided by zero")
