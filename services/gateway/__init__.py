"""The gateway: OpenAI-compatible HTTP API and the public gRPC API in front of the pdserve services."""
