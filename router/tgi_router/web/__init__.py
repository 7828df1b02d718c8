"""The HTTP layer shared by every route: admission (concurrency limit,
validation off the event loop, submission, events, cancelling what a
departed client leaves), the API key, the payload limit, the read deadline,
server-sent event framing, and the browsers' playground page.

May import: scheduling, request, text, tgi_router.errors."""
