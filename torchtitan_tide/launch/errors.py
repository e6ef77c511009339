"""The launcher's one error type (raised by the command line, the world and the checks)."""


class LaunchError(ValueError):
    """Bad launcher input; the message names the argument or variable and the fix."""
