"""Tokenizer service: stateless gRPC front of the model's tokenizer and chat template."""
