"""How every ``attnlab`` command refuses: ONE line starting with ``error:``, and an exit status.

A bad command line (an unknown command or option, a value of the wrong kind, a value the
command rejects) exits 2; a command stopped with Ctrl-C exits 130; a command that runs out of
memory exits 2 as well, since only its sizes can have caused it. None of them prints a
traceback, a usage block or a boxed panel: the one line says what was wrong and with which
option, which is all a user (or a script reading stderr) needs.

The behaviour lives in one place, :class:`OneLineErrorsGroup`, the class of the ``attnlab``
group. A group parses its own options, then parses and runs the sub-command inside its
``invoke``, so wrapping those two steps covers every command. Commands refuse by calling
:func:`fail`, or by running the shared checks of :mod:`attnlab._checks` under
:func:`option_errors`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer
from typer.core import TyperGroup

from attnlab._checks import non_negative_int

try:  # typer >= 0.16 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer with click installed
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError

__all__ = ["OneLineErrorsGroup", "fail", "option_errors", "at_most", "check_seed", "removed_on_failure", "MAX_SEED",
           "USAGE_EXIT", "INTERRUPTED_EXIT"]

USAGE_EXIT = 2  # click's own status for a bad command line
INTERRUPTED_EXIT = 130  # the shell's status for a process stopped by SIGINT (128 + 2)
# torch takes 64-bit seeds and `verify` multiplies its seed by 100 003: 32 bits keep both safe.
MAX_SEED = 2**32 - 1

# Phrases of torch's allocation failures: CUDA says "out of memory", the CPU allocator says
# "can't allocate memory" or "not enough memory". A RuntimeError without them is a bug to show.
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "not enough memory")


def fail(message: str) -> NoReturn:
    """Refuse the command line with ``message`` (one ``error:`` line, exit status 2)."""
    raise UsageError(message)


@contextmanager
def option_errors() -> Iterator[None]:
    """Turn the ``ValueError``/``TypeError`` of a check into a refusal of the command line.

    Use it around :mod:`attnlab._checks` calls that name the option (``positive_int("--heads",
    heads)``) and around lower-layer calls whose ``ValueError`` only ever means a bad argument.
    Other exceptions are left alone: they are bugs, and a bug should show its traceback.
    """
    try:
        yield
    except (ValueError, TypeError) as err:  # a bad value, or a value of the wrong kind
        fail(str(err))


def at_most(option: str, value: int, cap: int, why: str) -> int:
    """``value`` if it is at most ``cap``; a refusal naming ``option``, the cap and ``why`` otherwise."""
    if value > cap:
        fail(f"{option} must be at most {cap} ({why}), got {value}")
    return value


def check_seed(seed: int, option: str = "--seed") -> int:
    """``seed`` if torch can take it: a refusal naming ``option`` unless ``0 <= seed <= MAX_SEED``."""
    with option_errors():
        non_negative_int(option, seed)
    return at_most(option, seed, MAX_SEED, "seeds are 32-bit")


@contextmanager
def removed_on_failure(folder: Path) -> Iterator[None]:
    """Run a command that may create ``folder`` (its ``--out``); if it refuses or fails, remove
    what it created: ``folder`` and any parent that did not exist before, never a folder the user had.

    A refusal then leaves nothing behind, wherever the command made the folder.
    """
    created = None
    for path in (folder, *folder.parents):  # the topmost of the folders that do not exist yet
        if os.path.lexists(path):
            break
        created = path
    try:
        yield
    except BaseException as err:
        if created is not None and getattr(err, "exit_code", 1) != 0 and created.is_dir() and not created.is_symlink():
            shutil.rmtree(created, ignore_errors=True)
        raise


def _exit(message: str, code: int) -> NoReturn:
    """Print ``message`` as one ``error:`` line on stderr and exit with ``code``."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(code=code)


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    # typer.Exit is a RuntimeError too: it is a normal way out, never a memory failure.
    return isinstance(err, RuntimeError) and not isinstance(err, typer.Exit) and any(
        phrase in str(err) for phrase in _OUT_OF_MEMORY)


@contextmanager
def _one_line() -> Iterator[None]:
    """Run a parsing or invoking step, reporting every expected failure as one line."""
    try:
        yield
    except NoArgsIsHelpError:
        raise  # plain `attnlab` (or `attnlab CMD` needing arguments) prints its help, as click does
    except ClickException as err:  # usage errors (exit 2) and click's other user-facing errors
        _exit(err.format_message(), err.exit_code)
    except KeyboardInterrupt:
        _exit("interrupted", INTERRUPTED_EXIT)
    except (MemoryError, RuntimeError) as err:
        if not _is_out_of_memory(err):
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _exit(f"out of memory ({first_line}); try smaller sizes", USAGE_EXIT)


class OneLineErrorsGroup(TyperGroup):
    """The ``attnlab`` group: every command's errors become one ``error:`` line (see the module)."""

    def get_params(self, ctx):
        """The group's own options (``--help``), shown as flags."""
        from attnlab.lab.cli._help import plain_flags

        return plain_flags(super().get_params(ctx))

    def parse_args(self, ctx, args):
        """Parse the group's own options (``attnlab --bogus`` is refused here)."""
        with _one_line():
            return super().parse_args(ctx, args)

    def invoke(self, ctx):
        """Resolve, parse and run the sub-command (unknown commands and options, bad values)."""
        with _one_line():
            return super().invoke(ctx)

