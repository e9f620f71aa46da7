"""Secret options: each has a ``-file`` form and an environment variable, which keep it out of
the process list.

Every argument a process runs with is world-readable (``ps``, ``/proc/PID/cmdline``), so a key
or password given as ``--api-key KEY`` is visible to every user of the machine and to anything
that collects command lines. Each secret option therefore comes in three forms, read in this
order: the option itself (kept, but its help says ``ps`` shows it), ``--OPTION-file FILE`` (the
form Kubernetes Secrets mounted as files take), and a ``PDSERVE_*`` variable
(``pdserve.environment``). ``pdserve up`` hands secrets to its children inside their
configuration files (``--config``), never as arguments. A secret's value is never echoed: an
unreadable file is named, its content never is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PS_WARNING = "visible to every user of the machine in `ps`: prefer {file} or ${env}"


def add_secret_option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    env: str,
    help: str,
    metavar: str = "KEY",
) -> None:
    """``flag`` and ``flag-file`` for one secret; ``env``: the variable read when neither is given."""
    file_flag = f"{flag}-file"
    parser.add_argument(flag, metavar=metavar, help=f"{help} ({PS_WARNING.format(file=file_flag, env=env)})")
    parser.add_argument(
        file_flag,
        metavar="FILE",
        help=f"read {flag}'s value from FILE (its first line; a mounted Secret's file) "
        f"(default: ${env}, read when neither is given)",
    )


def read_secret_file(path: str, flag: str) -> str:
    """The secret in ``path`` (its first line, without the line end); ValueError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise ValueError(f"{flag} {path}: the file is empty")
    return lines[0].rstrip("\r\n")


def secret(args: argparse.Namespace, name: str, env_value: str | None) -> str | None:
    """The secret option ``name`` (its dest, e.g. ``admin_key``) from the option, then its file,
    then ``env_value`` (``pdserve.environment``'s reading of its variable)."""
    given = getattr(args, name, None)
    if given:
        return given
    path = getattr(args, f"{name}_file", None)
    if path:
        return read_secret_file(path, f"--{name.replace('_', '-')}-file")
    return env_value
