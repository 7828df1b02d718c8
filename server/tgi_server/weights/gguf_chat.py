"""Chat templates and end-of-turn tokens for GGUF files that lack them.

llama.cpp's converter writes `tokenizer.chat_template` only when the source
repository had one in its tokenizer_config.json; Gemma 3 files often come
without (llama.cpp then falls back to its built-in "gemma" format). We do the
same: a file of a family listed here that carries no template gets the
family's format, and the token that ends a turn stops generation as the
end-of-sequence token does."""

# Gemma 3's turn format: <start_of_turn>{user|model}\n...<end_of_turn>\n; a
# system message has no turn of its own and opens the first user turn,
# followed by a blank line; roles must alternate from the user; content is a
# string or a list of {"type": "text"} parts.
GEMMA_TEMPLATE = """{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] -%}
{%- set prefix = (system if system is string else system | map(attribute='text') | join('')) + '\\n\\n' -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set prefix = '' -%}
{%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{%- set content = message['content'] -%}
{%- set text = content if content is string else content | map(attribute='text') | join('') -%}
{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}
{{- (prefix if loop.first else '') + text | trim -}}
{{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<start_of_turn>model\\n' -}}
{%- endif -%}"""

# GGUF architecture -> (chat template, the token text that ends a turn)
FALLBACKS = {"gemma3": (GEMMA_TEMPLATE, "<end_of_turn>")}
