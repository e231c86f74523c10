"""A chat answer with the model's chat template, streamed, and the errors a caller may handle."""

import sys

from pdserve_sdk import Client, DeadlineExceededError, InvalidRequestError

messages = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
with Client(sys.argv[1] if len(sys.argv) > 1 else None) as client:
    for delta in client.chat_stream(messages, temperature=0, max_new_tokens=48):
        print(delta.text, end="", flush=True)
    print()
    try:
        client.chat(messages, top_p=1.5)
    except InvalidRequestError as err:
        print("rejected:", err.message)
    try:
        client.chat(messages, max_new_tokens=500, ignore_eos=True, timeout=0.05)
    except DeadlineExceededError as err:
        print("timed out:", err.code.name)
