"""decode-scheduler service: owns Req lifecycle after admission, the running batch and its KV pool."""
