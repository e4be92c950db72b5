"""One thin module per CLI command; each has `run(cfg, args) -> int` (the exit code).

cli.py parses the command line, builds the Config and imports the command's module lazily (so
`--help` and `config show` stay fast). The work is in the library; a command only calls it and
prints.
"""
