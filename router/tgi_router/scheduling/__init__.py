"""The step loop: the engine (one step in flight while the next is planned),
the scheduler (one accounting rule for prefill, chunked prefill and decode),
the paged KV block manager with prefix caching, the step pacer, sequences,
each request's stream of events, and the client of the shards' gRPC contract.
Pure Python: scheduler and block manager are tested without a model.

May import: request, text."""
