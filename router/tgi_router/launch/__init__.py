"""The launcher and its configuration: TGI's flags (and the generated flags
reference), token limits resolved from the shards' Info and Warmup, the shard
processes, and the router process's assembly (`server.serve_router`).

May import: everything else in the router (it is the top); nothing imports it
except tests and the console script."""
