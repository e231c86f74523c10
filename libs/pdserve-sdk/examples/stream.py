"""Print a completion as it is generated; stop early after 20 pieces (the server aborts the rest)."""

import sys

from pdserve_sdk import Client

with Client(sys.argv[1] if len(sys.argv) > 1 else None, timeout=60) as client:
    for i, delta in enumerate(client.stream("Once upon a time", max_new_tokens=200, temperature=0.7, seed=1)):
        print(delta.text, end="", flush=True)
        if i == 19:
            break
    print()
