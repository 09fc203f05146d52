"""The one distinction every command makes: a mistake the user can fix, or a bug.

A `UserError` (a bad config field, an unreachable server, a file that is not what it
should be, a corrupt checkpoint) is printed by `heterorl` as one line naming the
problem, exit status 2. Every other exception is a bug and keeps its traceback.
Each module's own error types derive from it (and from the builtin they always were,
so `except ValueError` callers keep working).
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; its message is one line that names it and says what to do."""
