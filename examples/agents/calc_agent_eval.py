"""The calc agent on the demo's held-out problems through any OpenAI-compatible endpoint — e.g.
``groupflow serve examples/calc_agent_demo.yaml --checkpoint runs/calc-agent-demo`` — unchanged
from training. An episode whose call fails (e.g. a conversation past the context length) counts as
wrong.

    python examples/agents/calc_agent_eval.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calc_agent import calc_agent  # noqa: E402

from groupflow.data.synthetic import make_task_rows  # noqa: E402


async def _episode(client, row) -> dict:
    try:
        return await calc_agent(client, row)
    except openai.APIError as exc:
        return {"reward": 0.0, "tools_used": 0.0, "error": str(exc)}


async def evaluate(base_url: str, api_key: str, rows: list[dict]) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    return await asyncio.gather(*(_episode(client, row) for row in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--problems", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="the demo run's run.seed")
    args = p.parse_args()
    _, heldout = make_task_rows("calc", 20000, args.problems, args.seed, digits=3)
    start = time.perf_counter()
    results = asyncio.run(evaluate(args.base_url, args.api_key, heldout))
    n = len(results)
    print(
        f"{n} held-out problems in {time.perf_counter() - start:.1f} s: accuracy "
        f"{sum(r['reward'] for r in results) / n:.1%}, tool used in "
        f"{sum(r['tools_used'] > 0 for r in results) / n:.0%}, failed calls "
        f"{sum('error' in r for r in results)}"
    )


if __name__ == "__main__":
    main()
