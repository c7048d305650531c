"""`python -m app.cli`: the launcher re-executes the command this way."""

import sys

from app.cli.main import main

sys.exit(main())
