"""`helm test` check: one chat completion through the gateway must come back with text.

Environment: PDSERVE_TEST_URL (the gateway's base URL, e.g. http://pdserve-gateway:8000),
PDSERVE_API_KEY (optional bearer token), PDSERVE_TEST_MAX_TOKENS (completion length, default 16),
PDSERVE_TEST_CA (PEM CA the gateway's HTTPS certificate chains to; default: the system's).
Exits non-zero with the reason when a call fails or the answer holds no letters.
"""

from __future__ import annotations

import os
import sys

import httpx


def main() -> None:
    key = os.environ.get("PDSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    verify = os.environ.get("PDSERVE_TEST_CA") or True
    url = os.environ["PDSERVE_TEST_URL"]
    with httpx.Client(base_url=url, headers=headers, timeout=120.0, verify=verify) as client:
        models = client.get("/v1/models").raise_for_status().json()
        model = models["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": int(os.environ.get("PDSERVE_TEST_MAX_TOKENS", "16")),
            "temperature": 0,
        }
        answer = client.post("/v1/chat/completions", json=body).raise_for_status().json()
    text = answer["choices"][0]["message"]["content"] or ""
    if not any(ch.isalpha() for ch in text):
        sys.exit(f"the answer holds no text: {answer!r}")
    print(f"{model} answered {text!r}")


if __name__ == "__main__":
    main()
