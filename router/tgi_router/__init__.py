"""The router: HTTP, validation, scheduling and the step loop; it talks to the
shards over gRPC and never imports torch, transformers or tgi_server.

Subpackages, lowest first (each imports only those before it, and errors):
text, request, scheduling, web, tgi_api, openai_compat, then app (the FastAPI
application), telemetry, launch. tests/router/test_layout.py holds the rule
that no module imports another in a cycle."""
