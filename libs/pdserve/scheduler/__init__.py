"""The scheduler core, transport-free: a ``Scheduler`` composed of small managers, one job per file.

One ``Scheduler`` serves three roles: ``mixed`` (colocated: a decode worker that prefills itself),
``prefill`` (a PD prefill worker) and ``decode`` (a PD decode worker). The role picks two managers,
how an admitted prompt gets its KV and what follows its first token:

    role      prefill stage                          decode stage
    mixed     PrefillManager (prefill.py)            DecodeManager (decode.py)
    prefill   PrefillManager                         HandOff (handoff.py)
    decode    RemotePrefill (remote_prefill.py)      DecodeManager

beside what every role has: the request table and its checks (table.py), the waiting queue with its
policy, grammar queue and overload limits (waiting.py, policy.py, grammar_queue.py, overload.py),
admission under the KV budget (admission.py), and the KV ledger of request slots, pages and the
radix cache (kv_ledger.py). A step builds a ``ScheduleBatch`` (schedule_batch.py), runs it on the
forward thread (batch_runner.py) and applies its result (output_processor.py). A request is a
``Req`` (req.py) carrying its ``Route`` (route.py).

The interface: what servicers and the scheduler loop use of a ``Scheduler``, and nothing else.

    every role
        add_request(req) -> int             queue a request (QueueFull, DuplicateRid, ValueError)
        abort_request(rid, reason, finish_reason) -> bool
        grammar_future(rid), grammar_timeout_reason(req)      a constrained request's compile
        request(rid), held_rids(), busy()   the requests held
        load() -> SchedulerLoad             GetLoad (and the gauges)
        set_hooks(on_request_end=...)       called as each request ends (tracing)
        role, page_size, config, runner, metrics              read only
    decode role
        pop_kv_requests(), waiting_for_kv(rid)                the prefills to ask for
        kv_ready(rid, token, ...), kv_failed(rid, error, retryable), kv_drained(rid)
        set_hooks(on_kv_abandoned=...)      called as a request ends while its KV arrives
    prefill role
        prefill_progress()                  prompts in chunks, with their tokens computed so far
        pop_prefilled(), prefill_sent(rid, ok, error)         first token sampled; KV sent
    the loop (``pdserve.services.common.scheduler_loop``)
        has_work(), schedule(), needs_results, run_batch(batch), process_result(batch, result),
        fail_batch(batch, error), fail_all(error), pop_aborted(), state_digest(), close(),
        clock (a TP group sets rank 0's reading of each step)

Where the next features plug in: a speculative proposer beside the decode stage
(``DecodeManager.num_tokens`` is how many tokens a running request computes in a step, and its KV
slots are grown for that many; its batch rows already carry per-request token counts); a request
resumed on another worker arrives as a prompt plus the ids it already generated
(``Req.output_ids``), the way a retracted request is re-admitted; who is admitted and who is
retracted first is the policy's (``SchedulePolicy.order``, ``SchedulePolicy.retraction_order``).

The step is schedule → run → process (SGLang's ``event_loop_normal``), and it may overlap (SGLang's
``event_loop_overlap``): the next ``schedule()`` may come before the previous batch's
``process_result``, while its forward runs. Everything that does not depend on the sampled token
ids is decided when a batch is scheduled (KV positions, chunk progress, a prompt's last chunk
turning into a decoding request), so the next batch can be built at once: a request whose token is
still being sampled decodes it as a *pending* input that the forward thread fills in from the
previous batch's result (``ScheduleBatch.resolve``). What depends on the token ids waits for
``process_result``: appending tokens, finishing (EOS, stop tokens), radix inserts, outputs. A
request that a pending token will bring to its length limit is not scheduled again; one that stops
at EOS runs one wasted row. The KV of a request that ends while a scheduled batch still holds it is
released when the last such batch is processed (``Req.in_batches``), so no forward reads a page or
request slot that was given to another request. Where a step would need token ids that are still
pending (penalties over the output, a grammar's next mask, a retraction of a request in flight),
``schedule()`` returns None with ``needs_results`` set: the caller processes the batch in flight
first and schedules again.
"""
