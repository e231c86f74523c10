"""Several chats at once with the asyncio client."""

import asyncio
import sys

from pdserve_sdk import AsyncClient, RetryPolicy

QUESTIONS = ["Name a colour.", "Name a fruit.", "Name a planet."]


async def main(address: str | None) -> None:
    async with AsyncClient(address, retry=RetryPolicy(max_retries=4, initial_backoff=0.2)) as client:
        print("health:", await client.health())
        answers = await asyncio.gather(
            *(
                client.chat([{"role": "user", "content": q}], temperature=0, max_new_tokens=24)
                for q in QUESTIONS
            )
        )
        for question, answer in zip(QUESTIONS, answers, strict=True):
            print(f"{question} -> {answer.text!r} ({answer.usage.completion_tokens} tokens)")
        async for delta in client.stream("Roses are red,", temperature=0, max_new_tokens=24):
            print(delta.text, end="", flush=True)
        print()


asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else None))
