"""What a valid request is: TGI's request and response JSON (pydantic) and
TGI's validation rules, which freeze a request into `ValidGenerateRequest`;
after validation nothing downstream re-checks it.

May import: text, tgi_router.errors."""
