"""Tools and environments referenced by import path in tests (``agent_helpers:Name``); the
``helpers_on_path`` fixture puts this directory on ``sys.path``."""

from __future__ import annotations

import asyncio
import sys
import threading
import time


def lookup(city: str, unit: str = "C", api_base: str = "x") -> str:
    """Current temperature of a city.

    Args:
        city: the city's name.
        unit: C or F.
        api_base: where to ask.
    """
    return f"{city}: 21{unit}"


def slow_tool(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(float(seconds))
    return "done"


def failing_tool(x: str) -> str:
    """Always fails.

    Args:
        x: anything.
    """
    raise RuntimeError(f"cannot handle {x}")


# Set by a test to end the calls below that wait on it; in a subprocess nobody does: they hang.
RELEASE = threading.Event()


def hang_tool(expression: str) -> str:
    """Never answers (until RELEASE is set), like a tool stuck on a dead connection.

    Args:
        expression: ignored.
    """
    RELEASE.wait(3600)
    return "late"


def exiting_tool(x: str) -> str:
    """Exits as an argparse-based CLI wrapper does on bad input.

    Args:
        x: anything.
    """
    sys.exit(2)


def interrupting_tool(x: str) -> str:
    """Raises KeyboardInterrupt, as code that catches and re-raises Ctrl-C may.

    Args:
        x: anything.
    """
    raise KeyboardInterrupt


class ExitingEnv:
    """``reset`` and ``step`` call ``sys.exit(0)``."""

    def reset(self, row):
        sys.exit(0)

    def step(self, text):
        sys.exit(0)


class InterruptingEnv:
    """``reset`` raises KeyboardInterrupt."""

    def reset(self, row):
        raise KeyboardInterrupt

    def step(self, text):
        return None, 0.0, True


class SleepingEnv:
    """A sync ``reset`` and ``step`` that never return (until RELEASE is set)."""

    def reset(self, row):
        RELEASE.wait(3600)

    def step(self, text):
        RELEASE.wait(3600)
        return None, 0.0, True


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no text for this")


def unprintable_tool(x: str):
    """Returns a value that cannot be turned into text.

    Args:
        x: anything.
    """
    return _Unprintable()


class CountdownEnv:
    """Answers every turn with the number of turns left; done after ``turns`` steps; reward 1 for
    each turn whose text contains the row's ``target`` string."""

    def __init__(self, turns: int = 2):
        self.turns = turns

    def reset(self, row):
        self.target = str(row.get("target", ""))
        self.left = self.turns
        return None

    def step(self, text):
        self.left -= 1
        reward = 1.0 if self.target and self.target in text else 0.0
        return (f"left {self.left}", reward, self.left <= 0)


class AsyncEchoEnv:
    async def reset(self, row):
        await asyncio.sleep(0)
        return f"start {row['prompt']}"

    async def step(self, text):
        await asyncio.sleep(0)
        return ({"role": "user", "content": f"echo {len(text)}"}, 0.5, False)


class RaisingEnv:
    def reset(self, row):
        return None

    def step(self, text):
        raise KeyError("the simulator crashed")


class UnbuildableEnv:
    def __init__(self, host: str = "sim.local"):
        raise ConnectionError(f"cannot reach the simulator at {host}")


class HangingEnv:
    def reset(self, row):
        return None

    async def step(self, text):
        await asyncio.sleep(60)


class GarbageEnv:
    def reset(self, row):
        return None

    def step(self, text):
        return "not a tuple"


class RandomResetEnv:
    """Breaks the group contract: every instance starts differently."""

    count = 0

    def reset(self, row):
        RandomResetEnv.count += 1
        return f"start {RandomResetEnv.count}"

    def step(self, text):
        return None, 0.0, True


SEEN: list[dict] = []


def record_trajectory(prompts, completions, messages, turns, tool_calls, env_rewards, trajectory):
    """Records what a multi-turn reward receives; scores the environment's summed reward."""
    SEEN.append(
        {"prompts": list(prompts), "completions": list(completions), "messages": list(messages),
         "turns": list(turns), "tool_calls": list(tool_calls), "env_rewards": list(env_rewards),
         "trajectory": list(trajectory)}
    )  # fmt: skip
    return [float(sum(r)) for r in env_rewards]


def needs_env_rewards(prompts, completions, env_rewards):
    """A reward that only a multi-turn workflow can feed."""
    return [float(sum(r)) for r in env_rewards]


class NumberPictureEnv:
    """Answers each model turn with a picture of a number (the turn count drawn as that many
    dark bars) and a question; done after three pictures. A vision-language test environment."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return None

    def step(self, text):
        from PIL import Image, ImageDraw

        self.turns += 1
        img = Image.new("RGB", (48, 32), (255, 255, 255))
        draw = ImageDraw.Draw(img)
        for k in range(self.turns):
            draw.rectangle([4 + 8 * k, 4, 8 + 8 * k, 28], fill=(0, 0, 0))
        content = [{"type": "image", "image": img}, {"type": "text", "text": "how many?"}]
        return {"role": "user", "content": content}, float(len(text) % 2), self.turns >= 3


class BrokenPictureEnv:
    """Answers with an image file that does not exist."""

    def reset(self, row):
        return None

    def step(self, text):
        return (
            {"role": "user", "content": [{"type": "image", "image": "/nonexistent/x.png"}]},
            0.0,
            False,
        )


class PictureFirstEnv:
    """Shows a picture at reset (the first observation extends the prompt); one turn."""

    def reset(self, row):
        from PIL import Image

        return {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (30, 30))}]}

    def step(self, text):
        return None, 1.0, True
