"""The `jopd` command line. Each command lives in `jopd/commands/<name>.py` with `add_arguments(parser)` and
`run(args) -> int`; this module only discovers and dispatches them, so commands stay independent."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import jopd.commands
from jopd.runtime.xla_flags import apply_cpu_defaults

# What `jopd --help` shows (this module's docstring is for developers).
DESCRIPTION = ("On-policy distillation of language models in JAX: a student model learns from its own samples, "
               "scored token by token by a frozen teacher.")
EPILOG = ("Start with `jopd train configs/testbed.yaml` (the CPU testbed, about 10 minutes on 2 cores); "
          "`jopd COMMAND -h` shows a command's options.")


def _command_modules() -> dict[str, object]:
    names = sorted(m.name for m in pkgutil.iter_modules(jopd.commands.__path__) if not m.name.startswith("_"))
    return {n: importlib.import_module(f"jopd.commands.{n}") for n in names}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jopd", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for name, mod in _command_modules().items():
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0] if mod.__doc__ else None,
                           description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_cpu_defaults()  # before any jax computation starts the CPU backend
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, KeyError) as e:  # bad input: one clear line, no traceback
        print(f"jopd {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that is missing, unreadable or unwritable, a full disk; a stall (TimeoutError)
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"jopd {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        if isinstance(e, TimeoutError):  # the other processes of a multi-process run may wait on this one
            from jopd.parallel.distributed import exit_if_multiprocess

            exit_if_multiprocess(2)
        return 2


if __name__ == "__main__":
    sys.exit(main())
