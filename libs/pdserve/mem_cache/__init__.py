"""KV memory: the request→token map, the paged KV allocator and pool, and the radix cache."""
