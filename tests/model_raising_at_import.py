"""A --model module whose import fails (test_plan_cli.BAD): the CLI must say so in one line, not a traceback."""

raise RuntimeError("boom at import")
