"""`python -m app.cli`: the launcher re-executes the command this way."""

from app.cli.main import run

run()
