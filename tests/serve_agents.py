"""Agents referenced by import path (``serve_agents:<name>``) in the agent-workflow tests.

Each is a plain ``openai``-client agent with one controlled behaviour (continue the conversation,
edit it, fail in a known way), and each appends what the server *returned* to it to ``SEEN`` —
the ids the client saw — so a test can compare them with the ids the run trains on. Not
collected by pytest (no ``test_`` prefix); tests put ``tests/`` on the path with the
``helpers_on_path`` fixture.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

SEEN: list[dict] = []  # one entry per call: row prompt, prompt_token_ids, token_ids, token_logprobs
# A file every call's SEEN entry is also appended to, with the process id, when this environment
# variable names one: an agent that runs in another process (the asynchronous rollout side, a Ray
# actor) reports through it what it was sent, and where it ran.
LOG_ENV = "SERVE_AGENTS_LOG"

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}},
    "required": ["expression"]}}}]  # fmt: skip


def _see(row, reply):
    for choice in reply.choices:
        seen = {"prompt": row["prompt"], "prompt_ids": reply.model_extra["prompt_token_ids"],
                "ids": choice.model_extra["token_ids"],
                "logprobs": choice.model_extra["token_logprobs"]}  # fmt: skip
        SEEN.append(seen)
        if os.environ.get(LOG_ENV):
            with open(os.environ[LOG_ENV], "a") as f:
                f.write(json.dumps({**seen, "pid": os.getpid()}) + "\n")


async def two_calls(client, row):
    """Ask, send the answer back with a tool result (or a user turn), ask again: one sample."""
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                 temperature=1.7)  # fmt: skip
    _see(row, reply)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "7"})
    else:
        messages.append({"role": "user", "content": "again"})
    reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    _see(row, reply)
    return 1.0 if len(reply.choices[0].message.content or "") % 2 else 0.0


async def two_calls_saying_where(client, row):
    """``two_calls``, and whether it ran on node B of the two-node fixture (whose processes alone
    have GROUPFLOW_DRIVER_ONLY set: tests/conftest.py), as the extra field ``on_node_b``."""
    reward = await two_calls(client, row)
    return {"reward": reward, "on_node_b": float("GROUPFLOW_DRIVER_ONLY" in os.environ)}


async def edits_history(client, row):
    """The second call rewrites the first answer: the calls are separate samples."""
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model="m", messages=messages)
    _see(row, reply)
    messages += [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "go"}]
    reply = await client.chat.completions.create(model="m", messages=messages)
    _see(row, reply)
    return {"reward": float(row["answer"][-1]) / 10, "edits": 1}


async def completions_api(client, row):
    """Token-in: the second call's prompt is the first's ids plus its completion."""
    first = await client.completions.create(model="m", prompt=row["prompt"], max_tokens=4)
    ids = (
        first.choices[0].model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    )
    second = await client.completions.create(model="m", prompt=ids + [5], max_tokens=4)
    SEEN.append({"prompt": row["prompt"], "first": first.choices[0].model_extra["token_ids"],
                 "second": second.choices[0].model_extra["token_ids"]})  # fmt: skip
    return 0.5


async def raises(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    raise RuntimeError("agent bug")


# Which rows misbehave, fixed per prompt in the order first seen (every other row): an episode
# that is run again after a blocked loop keeps its part, so the failure counts do not depend on
# how far each episode got before the block (a shared counter gave 3 failures under load).
_ROW_PARTS: dict[str, bool] = {}


def _misbehaves(row) -> bool:
    return _ROW_PARTS.setdefault(row["prompt"], len(_ROW_PARTS) % 2 == 1)


async def exits(client, row):
    """Every other row's episodes end with sys.exit(3) (a CLI-style helper inside the agent)."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    if _misbehaves(row):
        sys.exit(3)
    return 1.0


async def interrupts_in_a_task(client, row):
    """Every other row's episodes have a helper task raise KeyboardInterrupt, which asyncio lets
    out of the event loop itself (not only out of the task)."""

    async def helper():
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        if _misbehaves(row):
            raise KeyboardInterrupt
        return 1.0

    return await asyncio.create_task(helper())


async def calls_on(client, row):
    """Calls until refused, then returns a reward as if nothing happened."""
    for _ in range(10):
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
        except Exception:  # the server's 400 once the episode's calls are spent
            break
    return 1.0


RELEASE = threading.Event()  # set by a test to let the blocking agents' threads go


async def blocks_every_other(client, row):
    """Every other row's episodes block the event loop in sync code (time.sleep in an async def)."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    if _misbehaves(row):
        RELEASE.wait(30)
    return 1.0


async def blocks_in_a_task(client, row):
    """Blocks in a helper task, until released."""

    async def helper():
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        RELEASE.wait(60)
        return 1.0

    return await asyncio.create_task(helper())


async def sleeps(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    await asyncio.sleep(60)
    return 1.0


async def no_call(client, row):
    return 1.0


async def bad_return(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    return "yes"


async def no_reward(client, row):
    """Returns nothing: the configured reward functions score the conversation."""
    await two_calls(client, row)
    return None


def sync_agent(client, row):
    return 1.0


def messages_reward(prompts, completions, messages, agent_calls, **_):
    """The number of messages of the final conversation plus 10 × the agent's calls."""
    return [float(len(m)) + 10 * c for m, c in zip(messages, agent_calls)]


def varying_reward(prompts, completions, **_):
    """A deterministic value in [0, 1) that differs between (almost all) distinct completions: a
    group whose episodes answered differently carries a signal even where none is right."""
    return [(sum(map(ord, c)) % 101) / 100 for c in completions]


# ----- agent frameworks (imported inside: the tests skip where a package is missing) -------------
CALC_QUESTION = "2+3"
INSTRUCTIONS = "You are a calculator agent."


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. 2+3
    """
    from groupflow.tools.calculator import calculator

    return calculator(expression)


async def openai_sdk_agent(client, row):
    """The official client with function calling (as examples/agents/calc_agent.py)."""
    import json

    messages = [{"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": CALC_QUESTION}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}},
        "required": ["expression"]}}}]  # fmt: skip
    for _ in range(3):
        reply = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for c in message.tool_calls:
            result = calc(**json.loads(c.function.arguments))
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    return float((message.content or "").strip() == "5")


async def agents_sdk_agent(client, row):
    """The OpenAI Agents SDK: an Agent with a function tool, run by its Runner."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[function_tool(calc)],
                  model=OpenAIChatCompletionsModel(model="m", openai_client=client))  # fmt: skip
    result = await Runner.run(agent, CALC_QUESTION, max_turns=4)
    return float(str(result.final_output).strip() == "5")


async def langgraph_agent(client, row):
    """LangGraph's prebuilt ReAct agent over langchain-openai's ChatOpenAI."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(model="m", base_url=str(client.base_url), api_key=client.api_key,
                     max_retries=0, timeout=30)  # fmt: skip
    graph = create_react_agent(llm, [tool(calc)], prompt=INSTRUCTIONS)
    out = await graph.ainvoke({"messages": [("user", CALC_QUESTION)]}, {"recursion_limit": 8})
    return float(str(out["messages"][-1].content).strip() == "5")
