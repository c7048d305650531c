"""The `understudy` command line: argument parsing, subcommands, and the start-up re-exec."""

from app.cli.main import main

__all__ = ["main"]
