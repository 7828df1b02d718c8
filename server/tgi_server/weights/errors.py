"""Typed errors of checkpoint loading."""


class CheckpointError(Exception):
    """A checkpoint cannot be found, read or served.

    The message is one line that names the file or tensor at fault; the router
    maps it to TGI's error body, so it never carries a stack trace.
    """
