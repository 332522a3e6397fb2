"""Objects from a config's `_target_` mappings, with their constructors' own refusals as one line.

The config was checked against the target's signature when it was validated (trainer/configuration/spec.py);
what the constructor itself refuses (a value its checks reject, an argument clash) is known only
when it runs, here."""

from __future__ import annotations

from typing import Any, Callable

from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException

from trainer.infra.errors import UserError

#: What a constructor raises when it refuses its arguments: Python's own kinds, and Lightning's
#: (its callbacks and strategies raise MisconfigurationException, which subclasses neither).
ARGUMENT_ERRORS = (TypeError, ValueError, MisconfigurationException)


def construct(key: str, build: Callable[[], Any]) -> Any:
    """Run `build` (an instantiation of the `_target_` at config key `key`); a refusal by the
    constructor becomes a `UserError` naming `key`. Anything else keeps its traceback."""
    try:
        return build()
    except InstantiationException as ex:
        cause = ex.__cause__ or ex
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, ARGUMENT_ERRORS):
            raise UserError(key, f"the {key} constructor rejected its arguments: {cause}") from None
        raise
