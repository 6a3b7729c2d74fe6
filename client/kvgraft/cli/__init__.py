"""The `kvgraft` command line: one module per group of commands, `main` the entry point.

May import everything in kvgraft.
"""
