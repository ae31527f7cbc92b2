"""Errors of a run that the user can act on; the CLI prints them as one line."""


class RunError(Exception):
    """The run cannot go on as asked (e.g. a checkpoint of the other rollout mode); says what to do."""
