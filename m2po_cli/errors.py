"""Errors the user can act on. Each says what is wrong and where in one line; the CLI prints it and
exits 2. Every one derives from `UserError`, so the CLI catches one base; a module's own error class
says which part found the problem."""


class UserError(Exception):
    """A problem the user can fix (a recipe key, a data file, a model folder, a server, a run folder)."""


class RunError(UserError):
    """The run cannot go on as asked (e.g. a checkpoint of the other rollout mode); says what to do."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (a traceback-like text is not an error line)."""
    return (str(e).strip().splitlines() or [""])[0]
