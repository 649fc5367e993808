"""The one error type the user sees as a message rather than a traceback: bad input, a file that cannot
be used, a run that must stop. Every such error names the problem and the fix in its message."""

USER_ERROR_EXIT = 2  # a rank that stopped on a UserError, already printed
HANG_EXIT = 3  # a rank that stopped a hung run, after the stacks and the summary (resilience/watchdog.py)


class UserError(Exception):
    """Reported by the CLI as `hpc-train: error: <message>` (one line per problem), exit code 2."""


class RankFailed(UserError):
    """A rank of a local launch stopped with a UserError, already printed by that rank."""
