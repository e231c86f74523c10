"""Transport-free scheduler core: Req lifecycle, ScheduleBatch, policies, the KV ledger.

One ``Scheduler`` serves three roles: ``prefill`` (PD prefill worker), ``decode`` (PD decode worker)
and ``mixed`` (colocated: a decode worker that prefills itself).
"""
