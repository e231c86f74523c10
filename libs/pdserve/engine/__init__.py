"""The transport-free engine: ``ModelRunner`` and its ``ForwardBatch`` contract."""
