"""Prometheus metrics under TGI's names (and ours), their exposition, and
OTLP tracing of requests.

May import: web (tracing reads admitted requests)."""
