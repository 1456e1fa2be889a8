"""Errors a user can act on. Each message names the file, tensor or field and what was expected."""


class SplitspecError(Exception):
    """Base class: printed as one line by the CLI, returned as an error response by the server."""


class CheckpointError(SplitspecError):
    """A checkpoint (config, index, shard or tensor) is missing, malformed or inconsistent."""


class ConfigError(SplitspecError):
    """A configuration value (TP size, limits, placement, request parameter) is invalid."""


class ServerBusy(SplitspecError):
    """The server holds as many requests as it may (batch and wait queue full): refused at once, retry later
    (UNAVAILABLE, HTTP 503)."""
