"""The HTTP API: OpenAI's /v1/completions and /v1/chat/completions, and the SGLang-native /generate,
/tokenize and /detokenize.

Request models (``protocol*``, ``native_protocol``, ``structured_outputs``) bound every field; one
``serving_*`` module per endpoint turns a request into a ``GenerateReqInput`` and the outputs into a
response or SSE chunks (``stream_chunks``); a chat choice's text is read back by ``chat_output``
with the reasoning and tool-call parsers (``reasoning_parser``, ``tool_parsers/``).
"""
