"""A chat template that knows tools renders a tool conversation exactly as transformers'
apply_chat_template does (tools passed as ``tools=``, call arguments as mappings, its
``tojson``): Qwen2.5's template, the hermes family's home."""
from __future__ import annotations

import pytest

from pdserve.model.tokenizer import _render
from pdserve.router.http.openai_schema import chat_messages
from pdserve.router.http.tool_parsers import default_family
from pdserve.router.http.tools import for_template
from tests.unit.test_tool_parsers import CONVERSATION, TOOLS

# Qwen2.5-Instruct's chat template (its tool parts; the default system prompt kept).
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 (the template as Qwen ships it)


def test_a_template_that_knows_tools_renders_as_transformers_does():
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    assert default_family(QWEN25).name == "hermes"
    messages, tools = for_template(chat_messages(CONVERSATION), TOOLS, QWEN25)
    ours = _render(QWEN25, messages=messages, tools=tools, add_generation_prompt=True,
                   bos_token="", eos_token="<|im_end|>")
    theirs = utils.render_jinja_template(
        conversations=[messages], tools=TOOLS, chat_template=QWEN25,
        add_generation_prompt=True)
    theirs = theirs[0][0] if isinstance(theirs, tuple) else theirs
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           "</tool_call>" in ours and "<tool_response>\nsunny, 21 C\n</tool_response>" in ours


def test_the_default_rendering_reads_like_qwens():
    """The bundled template knows no tools: the default rendering writes what Qwen2.5's
    template writes for the same conversation, in the template's own frame."""
    smol = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    messages, tools = for_template(chat_messages(CONVERSATION), TOOLS, smol)
    ours = _render(smol, messages=messages, tools=tools, add_generation_prompt=True)
    qwen = _render(QWEN25, messages=chat_messages(CONVERSATION), tools=TOOLS,
                   add_generation_prompt=True)
    turns = qwen.split("<|im_start|>")[2:]   # after Qwen's system turn
    assert ours.split("<|im_start|>")[2:] == turns
