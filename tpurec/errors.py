"""The user-error type: what separates "you gave me something wrong" from "tpurec is wrong".

A `UserError` says the user's input or environment is at fault (a flag, a file, a table, a plan,
a model, a host without a TPU), in one line naming it and, where there is one, the fix. The
`tpurec` commands print it as that one line and exit 2 (tpurec/cli.py). Any other exception is a
bug (in tpurec or a library under it) and keeps its traceback, so it can be reported and fixed.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2  # argparse's exit code for a bad command line; the commands use it for every user error


class UserError(ValueError):
    """The user's input or environment is wrong; the message names it (file, table, field, limit).

    A ValueError too: a bad argument is a ValueError in Python's own vocabulary, and programs and
    tests written against tpurec before this type catch ValueError; they keep working. The reverse
    does not hold: a bare ValueError is not a UserError, so the commands show its traceback."""
