"""Turn formats: observation ids are exactly what the chat template adds after the model's turn,
so prompt ids + sampled ids + observation ids spell the template's own conversation."""

from __future__ import annotations

import pytest

from groupflow.agents.formats import ChatFormat, PlainFormat, TemplateError, tools_system_prompt
from groupflow.agents.tools import make_tool
from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.tools.calculator import calculator

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen-2.5 style: native tools= support, tool results wrapped in a user turn
NATIVE_TOOLS = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>"
    "{{ m['content'] }}</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer(template=CHATML):
    tok = train_char_tokenizer("<>_|/ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    return tok


def test_observation_after_eos_is_the_templates_continuation():
    tok = chatml_tokenizer()
    fmt = ChatFormat(tok)
    obs = [{"role": "tool", "content": "42"}]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert (
        fmt.observation_text(obs, eos)
        == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    # a turn cut by a stop string did not sample the end-of-turn token: the observation closes it
    assert fmt.observation_text(obs, tok.convert_tokens_to_ids("7")).startswith("<|im_end|>\n")


@pytest.mark.parametrize("template", [CHATML, NATIVE_TOOLS])
def test_token_in_token_out_spells_the_template_conversation(template):
    tok = chatml_tokenizer(template)
    fmt = ChatFormat(tok, [make_tool(calculator).schema])
    eos = tok.eos_token_id
    prompt = fmt.prompt_text("what is 6*7?")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    turn1 = tok("<tool_call>6*7</tool_call>", add_special_tokens=False)["input_ids"] + [eos]
    obs = [{"role": "tool", "content": "42"}]
    turn2 = tok("it is 42", add_special_tokens=False)["input_ids"] + [eos]
    seq = ids + turn1 + fmt.observation_ids(obs, turn1[-1]) + turn2
    conversation = [
        {"role": "user", "content": "what is 6*7?"},
        {"role": "assistant", "content": "<tool_call>6*7</tool_call>"},
        *obs,
        {"role": "assistant", "content": "it is 42"},
    ]
    expected = fmt.render(conversation, add_generation_prompt=False)
    assert tok.decode(seq) == expected.rstrip("\n")  # the template's trailing newline follows EOS


def test_tools_are_described_natively_or_in_a_system_prompt():
    schema = make_tool(calculator).schema
    native = ChatFormat(chatml_tokenizer(NATIVE_TOOLS), [schema])
    assert native.native_tools and "TOOLS: calculator" in native.prompt_text("q")
    plain = ChatFormat(chatml_tokenizer(), [schema])
    assert not plain.native_tools
    text = plain.prompt_text(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI model")
    assert text.count("<|im_start|>system") == 1
    assert '"name": "calculator"' in tools_system_prompt([schema])


def test_template_that_rewrites_history_is_refused():
    # drops every assistant turn but the last: appending a message rewrites earlier text
    rewriting = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fmt = ChatFormat(chatml_tokenizer(rewriting))
    with pytest.raises(TemplateError, match="rewrites earlier turns"):
        fmt.observation_ids([{"role": "tool", "content": "1"}], None)


def test_template_that_rejects_the_role_is_named():
    strict = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    fmt = ChatFormat(chatml_tokenizer(strict))
    with pytest.raises(TemplateError, match=r"role\(s\) \['tool'\].*roles must alternate"):
        fmt.observation_ids([{"role": "tool", "content": "1"}], None)


def test_chat_format_needs_a_template():
    tok = chatml_tokenizer()
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ChatFormat(tok)


def test_plain_format():
    tok = train_char_tokenizer()
    fmt = PlainFormat(tok, "={content}\n")
    assert fmt.prompt_text("mul 3*4 =") == "mul 3*4 ="
    ids = fmt.observation_ids([{"role": "tool", "content": "12"}], None)
    assert tok.decode(ids) == "=12\n"
    with pytest.raises(TemplateError, match="is not valid"):
        PlainFormat(tok, "{result}")
    with pytest.raises(TemplateError, match="chat template"):
        fmt.prompt_text([{"role": "user", "content": "q"}])


@pytest.mark.slow
def test_smollm2_template(smollm2_tokenizer):
    """SmolLM2's real template and BPE tokenizer: prompt ids + sampled ids + observation ids
    decode to exactly the template's own rendering of the conversation."""
    tok = smollm2_tokenizer
    fmt = ChatFormat(tok, [make_tool(calculator).schema])
    eos = tok.eos_token_id
    text = fmt.observation_text([{"role": "tool", "content": "12"}], eos)
    assert text == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    seq = tok(fmt.prompt_text("What is 3*4?"), add_special_tokens=False)["input_ids"]
    turn1 = tok(call, add_special_tokens=False)["input_ids"] + [eos]
    obs = [{"role": "tool", "content": "12"}]
    turn2 = tok("It is 12.", add_special_tokens=False)["input_ids"] + [eos]
    seq += turn1 + fmt.observation_ids(obs, eos) + turn2
    conversation = [
        {"role": "user", "content": "What is 3*4?"},
        {"role": "assistant", "content": call},
        *obs,
        {"role": "assistant", "content": "It is 12."},
    ]
    expected = fmt.render(conversation, add_generation_prompt=False)
    assert tok.decode(seq) == expected.rstrip("\n")
