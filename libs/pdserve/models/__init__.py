"""Model code (Llama family, Qwen2, Qwen3) and its checkpoint loader."""
