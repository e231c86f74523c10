"""Generate a completion, then the same from token ids.

python examples/generate.py [address]     # default: $PDSERVE_ADDRESS or 127.0.0.1:50051
"""

import sys

from pdserve_sdk import Client

with Client(sys.argv[1] if len(sys.argv) > 1 else None) as client:
    print("models:", client.models())
    result = client.generate("The capital of France is", temperature=0, max_new_tokens=16)
    print(repr(result.text), result.finish_reason, result.usage)
    # "The capital of France is" in SmolLM2's tokenizer (the default model)
    again = client.generate(input_ids=[504, 3575, 282, 4649, 314], temperature=0, max_new_tokens=8)
    print(again.token_ids)
