"""core: the words every layer shares — typed errors and exit codes (errors), names from files as plain
identifiers (names), temporary model state: mode, buffers, seeds (state).

May import: nothing else in graphgrow (the lowest layer; tests/test_architecture.py keeps the order).
"""
