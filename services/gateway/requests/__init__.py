"""The request path of one gateway replica (the gateway's share of SGLang's TokenizerManager).

``manager``: tokenize, admit (``admission``), fan out into sub-requests, route, send, abort, drain;
``state``: every client request's handle, its sub-requests and their output queue, by rid;
``token_pieces``: the text and bytes of token ids for logprobs.
"""
