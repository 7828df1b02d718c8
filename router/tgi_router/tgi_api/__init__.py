"""TGI's routes (/generate, /generate_stream, /, /health, /info, /metrics,
/tokenize) and TGI's JSON answers and timing headers.

May import: web, scheduling, request, tgi_router.errors."""
