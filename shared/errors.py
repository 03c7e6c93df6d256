"""Errors raised by the pure core for bad input.

Every error names what was wrong and where, so a command line can print one line and a service can route the
offending object to the dead-letter subject with a readable reason.
"""

from __future__ import annotations


class InvalidInput(ValueError):
    """An object or value that cannot be used, with the place it was found.

    ``where`` is a dotted path such as ``VirtualMachineInstance tenant-a/vm1: spec.domain.memory.guest``.
    """

    def __init__(self, message: str, where: str = "") -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)

    def at(self, where: str) -> InvalidInput:
        """Return the same error with ``where`` prefixed (used while descending into an object)."""
        if not self.where:
            joined = where
        elif self.where.startswith(("[", ".")):
            joined = f"{where}{self.where}"
        else:
            joined = f"{where}: {self.where}" if ":" not in where else f"{where}.{self.where}"
        return type(self)(self.message, joined)


class InvalidQuantity(InvalidInput):
    """A Kubernetes quantity string that does not parse, is negative where that is not allowed, or is absurd."""


SIM_INSTALL = "pip install 'vmquota[sim]' (from a source checkout: pip install -e '.[sim]')"
"""The install line that adds the development tools' packages (the simulated cluster, nats-server, CEL)."""


class MissingDependency(RuntimeError):
    """An optional package the command needs is not installed; the message names the install line that adds it."""
