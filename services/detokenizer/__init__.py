"""Detokenizer service: token-id batches from decode-schedulers in, text-delta batches to gateways out."""
