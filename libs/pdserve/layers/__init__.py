"""Model building blocks: linear layers with weight loaders, norms, rotary embedding, attention."""
