"""The main job's error for bad flags or environment, apart from the checks so that the parser's
and the data's modules raise it without importing the checks (which import the parser)."""


class UsageError(ValueError):
    """Bad flags or environment for the main job."""
