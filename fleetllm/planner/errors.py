"""The planner's refusal."""

from __future__ import annotations


class PlanError(ValueError):
    """A refusal: the spec cannot run as written. `reason` is a condition reason."""

    def __init__(
        self, reason: str, message: str, suggestions: tuple[str, ...] = (), lead: str = "Fits with"
    ) -> None:
        full = message
        if suggestions:
            full = f"{message}. {lead}: {'; or '.join(suggestions)}"
        super().__init__(full)
        self.reason = reason
        self.message = full
        self.suggestions = suggestions


class ArgsRefused(ValueError):
    """An engine's own parser would refuse the arguments; the message is its parser's."""
