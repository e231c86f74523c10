"""OpenAI's Responses API (/v1/responses) on the chat path: request and items (``protocol``,
``items``), the Response object (``objects``), its typed stream events (``stream``), the per-key
store of responses (``store``) and the endpoint (``serving``)."""
