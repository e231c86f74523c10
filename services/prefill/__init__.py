"""prefill-scheduler service: runs prompts and writes their KV pages into decode workers over NIXL."""
