"""A plain ``openai``-client agent with function calling, trained by groupflow through its server.

Referenced from a config as ``rollout.agent: examples/agents/calc_agent.py:calc_agent`` with
``rollout.workflow: agent``. groupflow calls it once per episode with an ``openai.AsyncOpenAI``
client pointed at the run's own server (an API key per episode, so every call is recorded) and
the dataset row (``prompt`` and the row's fields). Nothing here knows about groupflow: the same
function runs against any OpenAI-compatible endpoint, e.g. ``groupflow serve`` with the trained
checkpoint, or a hosted model.

The agent asks the model; when the model calls the ``calc`` tool, it runs the calculator and sends
the result back as a ``tool`` message; the model's last text is its answer. The return value is
the episode's reward (a dict: ``reward`` plus fields logged as ``rollout/agent/<name>``).
"""

from __future__ import annotations

import json

from groupflow.tools.calculator import calculator

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 347*582"}},
                "required": ["expression"],
            },
        },
    }
]


def run_tool(name: str, arguments: str) -> str:
    if name != "calc":
        return f"error: unknown tool {name!r}"
    try:
        return calculator(json.loads(arguments).get("expression", ""))
    except Exception as exc:  # a bad call is an observation the model learns from
        return f"error: {exc}"


async def calc_agent(client, row: dict, max_calls: int = 3) -> dict:
    messages = [{"role": "user", "content": row["prompt"]}]
    tool_calls = 0
    for _ in range(max_calls):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            tool_calls += 1
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = (message.content or "").strip()
    return {"reward": float(answer == str(row["answer"])), "tools_used": float(tool_calls)}
