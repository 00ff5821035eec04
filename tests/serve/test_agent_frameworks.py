"""Real agent code trains through the server: the official ``openai`` client with function
calling, the OpenAI Agents SDK and LangGraph (+ langchain-openai), each running a tool-using agent
as ``rollout.agent`` on a tiny CPU model. The model is first taught (a few supervised steps) to
call the ``calc`` tool in the tag format and then answer from the tool's result, so every episode
really goes model → tool call → framework runs the tool → tool message → model → answer.

For every recorded call: the ids trained are the ids sampled, and the training forward's
log-probs equal the sampling log-probs. Each framework's test skips, naming the package, where it
is not installed (the test extra pins them). Servers bind 127.0.0.1; one torch thread; every
episode is bounded by rollout.agent_timeout_s."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from groupflow.batch import Batch
from groupflow.config import config_from_dict
from groupflow.policies.llm import model_inputs

pytest.importorskip("openai", reason="needs the openai package (pip install openai)")

TESTS = str(Path(__file__).resolve().parents[1])
CALL, ANSWER = "<calc>2+3</calc>", "5"


@pytest.fixture(scope="module")
def trained(tiny_base, tmp_path_factory):
    """A run with the agent workflow whose tiny model calls the tool, then answers."""
    from groupflow.trainer import Trainer

    sys.path.insert(0, TESTS)
    import serve_agents

    torch.set_num_threads(1)
    base, with_overrides = tiny_base
    d = with_overrides(base(tmp_path_factory.mktemp("frameworks")), {
        "model.tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_positions": 128},
        "data.task": {"name": "calc", "digits": 2, "num_train": 64, "num_val": 4},
        "data.prompts_per_step": 1, "rollout.samples_per_prompt": 2, "rollout.temperature": 0.5,
        "rollout.max_new_tokens": 20, "rollout.max_response_tokens": 64, "rollout.stop": ["</calc>"],
        "rollout.workflow": "agent", "rollout.agent": "serve_agents:openai_sdk_agent",
        "rollout.tool_parser": "tag", "rollout.agent_timeout_s": 60, "serve.describe_tools": False,
    })  # fmt: skip
    t = Trainer(config_from_dict(d, "<frameworks>"))
    _teach(t, serve_agents.INSTRUCTIONS, serve_agents.CALC_QUESTION)
    yield t, serve_agents
    t.workflow.close()
    t.policy.shutdown()
    sys.path.remove(TESTS)


def _teach(trainer, instructions: str, question: str, steps: int = 400) -> None:
    tok = trainer.policy.tokenizer
    first = tok.apply_chat_template(
        [{"role": "system", "content": instructions}, {"role": "user", "content": question}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    second = first + CALL + "\ntool: 5\nassistant:"  # the template's tool turn after our call
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in (first, second)]
    targets = [tok(CALL, add_special_tokens=False)["input_ids"],
               tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]  # fmt: skip
    batch = Batch({}, {"prompt_token_ids": enc, "target_ids": targets})
    for _ in range(steps):
        loss = trainer.policy.sft_step(batch, 1e-2)
        if loss < 0.01:
            break
    assert loss < 0.05, f"the tiny model did not learn the tool call (loss {loss:.3f})"


def _recorded(workflow):
    """Wrap the recorder so the test sees every episode's calls as the server recorded them."""
    calls = []
    close = workflow.server.recorder.close

    def keep(key):
        out = close(key)
        calls.append(out)
        return out

    workflow.server.recorder.close = keep
    return calls


@pytest.mark.parametrize(
    "agent, package",
    [
        ("openai_sdk_agent", "openai"),
        ("agents_sdk_agent", "agents"),
        ("langgraph_agent", "langgraph"),
        ("langgraph_agent", "langchain_openai"),
    ],  # fmt: skip
)
def test_framework_agent_trains_on_exactly_what_it_sampled(trained, agent, package):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs the {package} package (pip install 'groupflow[test]')")
    trainer, agents = trained
    wf = trainer.workflow
    wf.agent = getattr(agents, agent)
    episodes = _recorded(wf)
    batch, m = wf.collect(wf.train_rows[:1], 0, 0, 0)
    assert m["rollout/agent/failures"] == 0
    assert m["rollout/agent/tool_call_rate"] == 1.0  # the framework ran the tool every episode
    assert m["rollout/agent/calls/mean"] == 2  # the call, then the answer from its result
    assert m["rollout/agent/samples_per_episode"] == 1  # the history came back unchanged
    assert batch["rewards"].tolist() == [1.0, 1.0]  # the agent's answer was the tool's result
    tok = trainer.policy.tokenizer
    for i, calls in enumerate(episodes):
        first, second = calls
        c1, c2 = first.completions[0], second.completions[0]
        assert tok.decode(c1.ids) == CALL and second.responses[0]["content"] == ANSWER
        m_i = batch["response_mask"][i].bool()
        # the ids trained: the sampled call, the tool turn (masked), the sampled answer
        between = second.prompt_ids[len(first.prompt_ids) + len(c1.ids) :]
        assert tok.decode(between) == "\ntool: 5\nassistant:"
        row = batch["responses"][i][: len(c1.ids) + len(between) + len(c2.ids)].tolist()
        assert row == c1.ids + between + c2.ids
        assert batch["responses"][i][m_i].tolist() == c1.ids + c2.ids
        assert batch["rollout_logprobs"][i][m_i].tolist() == pytest.approx(
            c1.logprobs + c2.logprobs, abs=1e-6
        )
    t = trainer.policy.sampling.temperature
    forward = trainer.policy.actor.compute_logprobs(model_inputs(batch), temperature=t)["logprobs"]
    mask = batch["response_mask"].bool()
    assert torch.allclose(forward[mask], batch["rollout_logprobs"][mask], atol=1e-5)
