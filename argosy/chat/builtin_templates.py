"""Chat templates Argosy ships for model families whose files carry none.

Gemma 3 270M ships as a base (pretrained) model: its GGUF has no `tokenizer.chat_template`. Its
family's turn format is Gemma's own (Google's published template, written here in our words):
a system message is folded into the first user turn, assistant turns are "model" turns, and
every turn ends with <end_of_turn>. A model's own template always wins; a `chat_template` in
the models file wins over both (core/service.py says which one a model uses).
"""

from __future__ import annotations

GEMMA = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with the user') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# architecture (config.json) -> (family name, template)
BUILTIN_TEMPLATES: dict[str, tuple[str, str]] = {
    "Gemma3ForCausalLM": ("gemma", GEMMA),
}


def builtin_template(architecture: str | None) -> tuple[str, str] | None:
    """(family, template) Argosy ships for this architecture, if any."""
    return BUILTIN_TEMPLATES.get(architecture or "")
