"""Model code (Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE, Gemma 3, gpt-oss) and its checkpoint loader."""
