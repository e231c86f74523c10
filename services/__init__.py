"""The five pdserve services: gateway, tokenizer, prefill, decode, detokenizer."""
