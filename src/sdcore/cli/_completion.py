"""``sdcore completion bash|zsh``: a completion script generated from the argument parser.

The script is derived from the parser itself, so a new command or option completes without
editing anything here. It completes command names, option names and the values of options
with fixed choices (``--status``, ``--log-level``, the shell of ``completion``).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sdcore.cli._format import emit
from sdcore.cli._options import add_command

SHELLS = ("bash", "zsh")

# Private argparse attributes, read-only: the only way to walk a parser (shtab does the same).
_SubParsers = argparse._SubParsersAction


@dataclass(slots=True)
class _Level:
    """What can follow one command path (``""``, ``"db"``, ``"db sql"``, …)."""

    commands: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    # Choices of positional arguments (the shell of ``completion``).
    values: list[str] = field(default_factory=list)
    # Options that consume the next word, with their choices ("" when free text).
    valued: dict[str, list[str]] = field(default_factory=dict)


def _walk(parser: argparse.ArgumentParser, path: str, levels: dict[str, _Level]) -> None:
    level = levels.setdefault(path, _Level())
    for action in parser._actions:
        if isinstance(action, _SubParsers):
            for name, child in action.choices.items():
                level.commands.append(name)
                _walk(child, f"{path} {name}".strip(), levels)
            continue
        if not action.option_strings:
            level.values.extend(str(choice) for choice in action.choices or ())
            continue
        level.options.extend(action.option_strings)
        if action.nargs != 0:
            choices = [str(choice) for choice in action.choices or ()]
            for option in action.option_strings:
                level.valued[option] = choices


def _bash_function(parser: argparse.ArgumentParser) -> list[str]:
    levels: dict[str, _Level] = {}
    _walk(parser, "", levels)
    takes_value = sorted({option for level in levels.values() for option in level.valued})
    lines = [
        "_sdcore() {",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
        '    local path="" word i skip=0 words=""',
        "    for (( i = 1; i < COMP_CWORD; i++ )); do",
        '        word="${COMP_WORDS[i]}"',
        "        if (( skip )); then skip=0; continue; fi",
        '        case "$word" in',
    ]
    if takes_value:
        lines.append(f"            {' | '.join(takes_value)}) skip=1; continue ;;")
    lines += [
        "            -*) continue ;;",
        "        esac",
        '        case "$path:$word" in',
    ]
    for path, level in sorted(levels.items()):
        for command in level.commands:
            key = shlex.quote(f"{path}:{command}")
            lines.append(f'            {key}) path="{f"{path} {command}".strip()}" ;;')
    lines += [
        "        esac",
        "    done",
        "    if (( skip )); then",
        '        case "$path:$prev" in',
    ]
    for path, level in sorted(levels.items()):
        for option, choices in sorted(level.valued.items()):
            if choices:
                lines.append(
                    f"            {shlex.quote(f'{path}:{option}')}) "
                    f"words={shlex.quote(' '.join(choices))} ;;"
                )
    lines += [
        "        esac",
        '        COMPREPLY=( $(compgen -W "$words" -- "$cur") )',
        "        return 0",
        "    fi",
        '    case "$path" in',
    ]
    for path, level in sorted(levels.items()):
        words = " ".join([*level.commands, *level.values, *level.options])
        lines.append(f"        {shlex.quote(path)}) words={shlex.quote(words)} ;;")
    lines += [
        "    esac",
        '    COMPREPLY=( $(compgen -W "$words" -- "$cur") )',
        "}",
    ]
    return lines


def completion_script(parser: argparse.ArgumentParser, shell: str) -> list[str]:
    """Return the lines of a completion script for ``shell``.

    Args:
        parser: The ``sdcore`` parser.
        shell: ``"bash"`` or ``"zsh"`` (zsh loads it through ``bashcompinit``).

    Returns:
        The script; ``eval "$(sdcore completion bash)"`` in ``~/.bashrc`` enables it.

    Raises:
        ValueError: Another shell.
    """
    if shell not in SHELLS:
        raise ValueError(f"unsupported shell {shell!r}")
    head = [f'# sdcore {shell} completion: eval "$(sdcore completion {shell})"']
    if shell == "zsh":
        head += ["autoload -U +X bashcompinit && bashcompinit"]
    return [*head, *_bash_function(parser), "complete -o default -F _sdcore sdcore"]


def register(subparsers: Any) -> None:
    """Add ``sdcore completion bash|zsh``."""
    completion = add_command(
        subparsers,
        "completion",
        _completion,
        help="print a shell completion script (bash or zsh)",
    )
    completion.add_argument(
        "shell",
        choices=SHELLS,
        help='bash: eval "$(sdcore completion bash)"; zsh: eval "$(sdcore completion zsh)"',
    )


def _completion(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    from sdcore import __version__
    from sdcore.cli._parser import build_parser  # builds every command, this one included

    for line in completion_script(build_parser(__version__), args.shell):
        emit(line)
