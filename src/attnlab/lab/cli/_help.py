"""How every ``attnlab`` command shows its ``--help``: flags as flags, and defaults that live in the lab.

typer's rich help prints a boolean flag as ``--causal <bool>``, as if it took a value; here a flag
reads ``--causal`` (or ``--attention-only / --mlp``), as it is typed. A command whose defaults
belong to a lab module (``train``'s per-task sizes, ``explain``'s tutorial sizes) names a function
that returns them; it runs only when the help is shown, so a command's module imports no lab
module at start-up (see docs/design.md, "Rules").
"""

from __future__ import annotations

from collections.abc import Callable

from typer.core import TyperCommand, TyperOption

__all__ = ["HelpCommand", "command_class", "plain_flags"]


def plain_flags(params: list) -> list:
    """``params`` with every boolean flag shown without a value type (no ``<bool>``)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_bool_flag and param.metavar is None:
            param.metavar = ""  # typer's rich help prints the metavar, when set, as the type
    return params


class HelpCommand(TyperCommand):
    """An ``attnlab`` sub-command: flags read as flags in ``--help`` (see the module)."""

    help_defaults: Callable[[], dict[str, str]] | None = None

    def get_params(self, ctx):
        """The command's options, its flags shown as flags."""
        return plain_flags(super().get_params(ctx))

    def format_help(self, ctx, formatter) -> None:
        """Fill the defaults ``help_defaults`` gives (parameter name -> text), then show the help."""
        if self.help_defaults is not None:
            shown = self.help_defaults()
            for param in self.params:
                if param.name in shown:
                    param.show_default = shown[param.name]
        super().format_help(ctx, formatter)


def command_class(help_defaults: Callable[[], dict[str, str]]) -> type[HelpCommand]:
    """A :class:`HelpCommand` whose ``--help`` shows the defaults ``help_defaults()`` returns.

    Example:
        >>> command_class(lambda: {"steps": "2000"}).help_defaults()
        {'steps': '2000'}
    """
    return type("HelpCommand", (HelpCommand,), {"help_defaults": staticmethod(help_defaults)})
