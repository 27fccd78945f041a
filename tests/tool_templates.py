"""Chat templates that teach tiny test models to call tools, one per format the server parses, written for these
tests in the shape of the real families' templates: Llama 3.1's JSON calls (tools in a system turn, calls as
``{"name": ..., "parameters": ...}``, results in an ``ipython`` turn) and Qwen 2.5's Hermes calls (tools in
``<tools>``, calls in ``<tool_call>`` blocks, results in ``<tool_response>`` blocks of a user turn), and a helper that
gives a tiny checkpoint one of them.
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_TOOLS = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You may call these functions. To call one, answer with a JSON object "
    '{"name": function name, "parameters": its arguments}.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message.tool_calls %}"
    '{{ \'{"name": "\' + call.function.name + \'", "parameters": \' + (call.function.arguments | tojson) + \'}\' }}'
    "{% endfor %}<|eot_id|>"
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama 3.1-style: the server's default parser for it is ``llama3_json`` (``<|start_header_id|>`` and tools)."""

QWEN_TOOLS = (
    "{% if tools %}<|im_start|>system\nYou may call functions. Their signatures are in <tools></tools>:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\nFor each call, answer with\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen 2.5-style: the server's default parser for it is ``hermes`` (``<tool_call>``)."""


def use_template(weights_dir: str | Path, template: str) -> None:
    """Give the checkpoint in ``weights_dir`` this chat template."""
    path = Path(weights_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))
