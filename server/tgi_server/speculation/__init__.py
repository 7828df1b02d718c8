"""Speculative decoding on the shard: proposers that draft tokens after a
sequence's last known token (n-gram lookup over its own tokens) and the
check that keeps exactly the tokens decoding without drafts would give
(verify.py)."""
