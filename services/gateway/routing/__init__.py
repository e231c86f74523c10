"""Which workers serve a sub-request: the decode-scheduler (and prefill-scheduler) of each.

``workers``: the pools of each role and what the gateway knows of each worker; ``policies``:
round-robin, least-load, cache-aware (over ``prefix_tree``); ``router``: a ``Route`` per
sub-request; ``worker_monitor``: health and load probes; ``discovery``: DNS-named pools.
"""
