"""An environment for groupflow's multi-turn workflow: guess a secret number, told higher/lower.

Referenced from a config as ``rollout.environment: {class: examples/agents/guess_number.py:GuessNumber}``
(a file path relative to where you run groupflow, or ``my_pkg.module:Class``). groupflow makes one
instance per sample and calls, on the driver:

    reset(row) -> first observation (text, a chat message, a list of them, or None)
    step(text) -> (observation, reward, done)   # text: the model's turn, decoded

Either may be ``async def`` (e.g. to query a remote simulator). Anything the methods raise, a call
that takes longer than ``rollout.env_timeout_s``, or a return value of the wrong shape ends that
sample with ``reward.failure_value`` and is counted in ``rollout/env_failures``; the step goes on.
The observation is tokenized once and appended to the sample, masked out of the loss.

``reset`` must depend only on the row (all G samples of a group see the same prompt): draw any
randomness from a row field, as ``secret`` here.
"""

from __future__ import annotations

import re


class GuessNumber:
    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 7):
        self.low, self.high, self.max_guesses = low, high, max_guesses

    def reset(self, row: dict) -> str:
        self.secret = int(row["secret"])
        self.guesses = 0
        return f"guess {self.low}-{self.high}:"

    def step(self, text: str):
        numbers = re.findall(r"-?\d+", text)
        self.guesses += 1
        if not numbers:
            return "say a number:", 0.0, self.guesses >= self.max_guesses
        guess = int(numbers[-1])
        if guess == self.secret:
            return None, 1.0, True  # the episode's reward; rewards read it as env_rewards
        hint = "higher:" if guess < self.secret else "lower:"
        return hint, 0.0, self.guesses >= self.max_guesses
