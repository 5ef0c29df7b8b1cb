"""The ``eagle3`` console script: one parser, one subcommand per pipeline step.

Each subcommand's arguments and runner live next to the code they drive (``client/cli.py``,
``draft_trainer/cli.py``, ``eagle3/demo.py``); this module only wires them and turns known errors
into a one-line message and exit status 1. Unknown or misspelled options exit with status 2 and
name the option (argparse abbreviations are off: ``--max`` never silently means ``--max-length``).
A command that needs the verifier and got no ``--model`` (``MissingModelError``, raised before any
work) is a usage error too: status 2, the subcommand's usage and what to pass.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from eagle3 import __version__
from eagle3.client.cli import add_prepare_command
from eagle3.client.distill_cli import add_distill_command
from eagle3.client.extract_cli import add_extract_command
from eagle3.client.self_instruct_cli import add_reading_prompts_command, add_self_instruct_command
from eagle3.core.cli_args import MissingModelError
from eagle3.core.errors import Eagle3Error
from eagle3.core.progress import quiet_foreign_bars
from eagle3.demo import add_demo_command
from eagle3.draft_trainer.cli import add_trainer_commands, add_vocab_command
from eagle3.server.cli import add_serve_command
from eagle3.train import server_source

# Every error eagle3 raises on purpose derives from Eagle3Error (core/errors.py); OSError covers an
# unreadable input or an unwritable output directory. Anything else is a bug and keeps its traceback.
USER_ERRORS = (Eagle3Error, OSError)

# A third-party module a command imports when it runs -> the extra of pyproject.toml that installs it. The
# bare `pip install eagle3` is the SDK and prepare; a command that needs more names its extra instead of
# ending in a ModuleNotFoundError traceback. torch comes with several extras: which one depends on the command.
EXTRA_OF_MODULE = {
    "fastapi": "server",
    "uvicorn": "server",
    "starlette": "server",
    "pydantic": "server",
    "prometheus_client": "server",
    "vllm": "vllm",
    "gguf": "embedded",
    "accelerate": "embedded",
    "datasets": "data",
    "pyarrow": "data",
    "tensorboard": "track",
    "wandb": "track",
    "PIL": "train",
}
TORCH_EXTRA_OF_COMMAND = {"serve": "server", "demo": "server,train", "prepare": "embedded", "distill": "embedded"}


def missing_extra(command: str, module: str | None) -> str | None:
    """The one-line error for a command whose optional dependency ``module`` is not installed, or None
    when ``module`` belongs to no extra (a broken base install or a bug keeps its traceback)."""
    top = (module or "").split(".")[0]
    extra = TORCH_EXTRA_OF_COMMAND.get(command, "train") if top == "torch" else EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return f"this command needs {top!r}, which is not installed: pip install 'eagle3[{extra}]'"


class ArgumentParser(argparse.ArgumentParser):
    """argparse without abbreviations, and with a 'did you mean' for unknown options."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def unknown_options(self, extras: list[str]) -> NoReturn:
        known = [s for a in self._actions for s in a.option_strings]
        parts = []
        for extra in extras:
            name = extra.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        label = "option" if len(parts) == 1 else "options"
        self.error(f"unrecognized {label}: {', '.join(parts)}")


def vllm_eval_engine_args(model_dir: Path, dtype: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    """``eagle3 eval --engine vllm``'s engine settings for the target family: the vllm backend's
    (``server/backends/vllm_family.py`` ``eval_engine_args``; the trainer never imports the server, the
    console wires the two). Imported when called: ``import eagle3.cli`` loads no torch."""
    from eagle3.server.backends.vllm_family import eval_engine_args

    return eval_engine_args(model_dir, dtype, engine_args)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="eagle3", description="Train EAGLE-3 draft models against a resident verifier.")
    parser.add_argument("--version", action="version", version=f"eagle3 {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser)
    add_prepare_command(sub)
    add_vocab_command(sub)
    add_distill_command(sub)
    add_self_instruct_command(sub)
    add_reading_prompts_command(sub)
    add_extract_command(sub)
    add_trainer_commands(sub, make_source=server_source, vllm_engine_settings=vllm_eval_engine_args)
    add_demo_command(sub)
    add_serve_command(sub)
    for command in _subcommands(parser).values():  # `eagle3 train -v ...` as well as `eagle3 -v train ...`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    return parser


def _subcommands(parser: ArgumentParser) -> dict[str, ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _reject_unknown_options(parser: ArgumentParser, argv: list[str]) -> None:
    """Name unknown options before anything else (a missing required option must not hide them)."""
    commands = _subcommands(parser)
    index = next((i for i, a in enumerate(argv) if a in commands), None)
    if index is None:
        return
    sub = commands[argv[index]]
    known = {s for a in sub._actions for s in a.option_strings}
    rest = argv[index + 1 :]
    rest = rest[: rest.index("--")] if "--" in rest else rest
    unknown = [
        a for a in rest if a.startswith("-") and a != "-" and not a[1:2].isdigit() and a.split("=", 1)[0] not in known
    ]
    if unknown:
        sub.unknown_options(unknown)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    _reject_unknown_options(parser, argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request is noise
    quiet_foreign_bars(sys.stderr)  # transformers' \r bar frames in a log (make demo > log)
    try:
        return int(args.func(args))
    except MissingModelError as exc:
        _subcommands(parser)[args.command].error(str(exc))
    except USER_ERRORS as exc:
        print(f"eagle3 {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        message = missing_extra(args.command, exc.name)
        if message is None:
            raise
        print(f"eagle3 {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"eagle3 {args.command}: interrupted", file=sys.stderr)
        return 130
